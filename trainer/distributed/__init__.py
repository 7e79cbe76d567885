"""Runs over several processes: `devices` (jax.distributed and host devices, set up before
jax starts) and `launch` (`python -m trainer.distributed.launch`, N local processes)."""
