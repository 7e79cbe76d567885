"""Host and process setup that must happen before jax initialises its backends.

A run is one process (the default) or several that form one global device set
through `jax.distributed`. `initialize` decides which from the environment:

- `JAX_NUM_PROCESSES` and `JAX_PROCESS_ID` (with `JAX_COORDINATOR_ADDRESS`,
  `host:port` of process 0), as `python -m trainer.distributed.launch` sets them, or as a
  user sets them on each host of a cluster;
- `TRAINER_DISTRIBUTED=auto`: `jax.distributed.initialize()` with no
  arguments, which finds its settings itself on SLURM, Open MPI, Kubernetes
  and Cloud TPU pods;
- neither: one process.

On CPU the processes reach each other through gloo collectives.
"""

from __future__ import annotations

import contextlib
import os

import jax
from absl import logging

NUM_PROCESSES_ENV = "JAX_NUM_PROCESSES"
PROCESS_ID_ENV = "JAX_PROCESS_ID"
COORDINATOR_ENV = "JAX_COORDINATOR_ADDRESS"  # jax.distributed.initialize reads it too.
AUTO_ENV = "TRAINER_DISTRIBUTED"
#: XLA:CPU sizes its thread pool from this variable (default: the larger of the cores and
#: the devices).
HOST_THREADS_ENV = "PJRT_NPROC"
#: Threads of that pool per host device (`reserve_host_threads`).
HOST_THREADS_PER_DEVICE = 8


def _env_int(name: str) -> int:
  value = os.environ[name]
  try:
    return int(value)
  except ValueError:
    raise ValueError(f"environment variable {name}={value!r} must be an integer.") from None


def distributed_settings() -> dict | None:
  """The `jax.distributed.initialize` arguments the environment asks for (None: one process).

  Raises:
    ValueError: the variables are incomplete, not integers, or out of range.
  """
  auto = os.environ.get(AUTO_ENV, "")
  if auto not in ("", "auto"):
    raise ValueError(f"environment variable {AUTO_ENV}={auto!r} must be 'auto' (let "
                     f"jax.distributed.initialize() detect the cluster) or unset.")
  if NUM_PROCESSES_ENV not in os.environ:
    if PROCESS_ID_ENV in os.environ:
      raise ValueError(f"environment variable {PROCESS_ID_ENV} is set but {NUM_PROCESSES_ENV} "
                       f"is not; set both (and {COORDINATOR_ENV}) for a multi-process run.")
    return {} if auto else None
  num = _env_int(NUM_PROCESSES_ENV)
  pid = _env_int(PROCESS_ID_ENV) if PROCESS_ID_ENV in os.environ else None
  if num < 1:
    raise ValueError(f"environment variable {NUM_PROCESSES_ENV}={num} must be >= 1.")
  if pid is None or not 0 <= pid < num:
    raise ValueError(f"environment variable {PROCESS_ID_ENV}={pid} must be set to an integer "
                     f"in [0, {num}) when {NUM_PROCESSES_ENV}={num}.")
  if num == 1:
    return None
  if not os.environ.get(COORDINATOR_ENV):
    raise ValueError(f"environment variable {COORDINATOR_ENV} (host:port of process 0) must "
                     f"be set when {NUM_PROCESSES_ENV}={num}.")
  return dict(coordinator_address=os.environ[COORDINATOR_ENV], num_processes=num,
              process_id=pid)


def reserve_host_threads(n: int) -> None:
  """Gives XLA:CPU's thread pool `HOST_THREADS_PER_DEVICE` threads per host device, unless
  the environment already names its size (`HOST_THREADS_ENV`). Call it before jax starts.

  A collective holds a pool thread while it waits for the other devices, and a device's
  program may wait in several at once (independent chains, programs queued behind each
  other). At XLA's default size (the larger of the cores and the devices: 8 threads for 8
  devices on 2 cores), the waits of the devices that ran ahead filled the pool, the others
  never reached the collective, and XLA aborted the process 40 s later ("Termination
  timeout ... only 7 of them arrived"). Measured here: 3,000 queued calls of one program
  with an all-reduce over 8 devices deadlocked with 8 or 12 threads and ran with 16, 24 or
  32; `benchmarks/strategy_step_time.py`'s step times did not change with 64. The suite
  queues 2,000 such calls (`tests/test_devices.py`).
  """
  if n > 1 and HOST_THREADS_ENV not in os.environ:
    os.environ[HOST_THREADS_ENV] = str(max(os.cpu_count() or 1, HOST_THREADS_PER_DEVICE * n))


def set_num_cpu_devices(n: int) -> None:
  """Makes a CPU-only host expose `n` devices (0 or None: jax's default).

  Call it before any jax computation. On hosts with an accelerator it changes
  nothing that runs there: only the CPU platform's device count is set.

  Raises:
    RuntimeError: jax's backends were already initialised with another count.
  """
  if not n:
    return
  reserve_host_threads(int(n))
  try:
    jax.config.update("jax_num_cpu_devices", int(n))
  except RuntimeError as e:
    if len(jax.devices("cpu")) != n:
      raise RuntimeError(
          f"config.num_cpu_devices={n} must be set before jax starts, but jax already "
          f"runs with {len(jax.devices('cpu'))} CPU devices.") from e
  logging.info("CPU devices: %d; default backend: %s with %d device(s).",
               len(jax.devices("cpu")), jax.default_backend(), jax.device_count())


def initialize(num_cpu_devices: int = 0) -> None:
  """Joins the processes of a multi-process run (if the environment names one) and
  makes the CPU devices: `num_cpu_devices` in all, split evenly over the processes.

  So the same config gives the same global device set on 1 process x 8 devices
  and on 2 processes x 4. Processes other than 0 log warnings and errors only.

  Raises:
    ValueError: the environment's settings are malformed, or `num_cpu_devices`
      does not split evenly over the processes.
  """
  settings = distributed_settings()
  if settings is None:
    set_num_cpu_devices(num_cpu_devices)
    return
  if settings.get("process_id"):  # Quiet from the start; a cluster's id is known below.
    logging.set_verbosity(logging.WARNING)
  # Collectives between CPU devices of different processes (no effect on GPU/TPU).
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(**settings)
  # The process id and count are known now (a cluster's too), before jax's backends start.
  from jax._src import distributed as jax_distributed
  if jax_distributed.global_state.process_id:
    logging.set_verbosity(logging.WARNING)
  num = jax_distributed.global_state.num_processes or settings.get("num_processes", 1)
  if num_cpu_devices and num_cpu_devices % num:
    raise ValueError(f"config.num_cpu_devices={num_cpu_devices} (devices in all) does not "
                     f"split evenly over the run's {num} processes.")
  if num_cpu_devices:
    reserve_host_threads(num_cpu_devices // num)
    jax.config.update("jax_num_cpu_devices", num_cpu_devices // num)
  logging.info("Process %d of %d: %d local device(s), %d in all (%s).", jax.process_index(),
               jax.process_count(), jax.local_device_count(), jax.device_count(),
               jax.default_backend())


def process_label() -> str:
  """`process i of n` (empty in a one-process run): what errors and logs are tagged with."""
  if jax.process_count() == 1:
    return ""
  return f"process {jax.process_index()} of {jax.process_count()}"


@contextlib.contextmanager
def naming_the_process():
  """Adds `(in process i of n)` to any exception that leaves the block, on a multi-process run."""
  try:
    yield
  except BaseException as e:
    label = process_label() if jax.distributed.is_initialized() else ""
    if label and not isinstance(e, (KeyboardInterrupt, SystemExit)):
      e.add_note(f"(raised in {label})")
    raise


def is_primary() -> bool:
  """Whether this process writes the run's logs and files (process 0)."""
  return jax.process_index() == 0
