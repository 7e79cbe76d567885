"""The keys of one step's RNG streams, as the model and the hooks read them.

A step draws one key per stream of `Trainer.rng_streams` (`Trainer.step_rngs`) and
hands them to the model as an `RngStreams` mapping: reading a stream the Trainer
does not draw raises `MissingRngStreamError`, naming `Trainer.rng_streams` and the
line to add, where a plain dict would raise a bare `KeyError`.
"""

import jax


class MissingRngStreamError(ValueError):
  """The model (or `model_inputs`) read an RNG stream that `Trainer.rng_streams` lacks."""


class RngStreams(dict):
  """The keys of one step's RNG streams; a missing stream names `Trainer.rng_streams`.

  A pytree like a dict (its keys sorted), so a hook can pass it into its own
  `jax.jit` function; inside, a missing stream raises the same error.
  """

  def __missing__(self, name):
    raise MissingRngStreamError(
        f"the model asked for RNG stream {name!r}, but the trainer draws only "
        f"{sorted(k for k in self if k != 'params')}: add {name!r} to the Trainer "
        f"subclass's rng_streams (e.g. rng_streams = {(*sorted(self), name)!r}).")


jax.tree_util.register_pytree_with_keys(
    RngStreams,
    lambda streams: ([(jax.tree_util.DictKey(k), streams[k]) for k in sorted(streams)],
                     tuple(sorted(streams))),
    lambda names, keys: RngStreams(zip(names, keys, strict=True)))
