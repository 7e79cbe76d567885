"""Every launched test process keeps its compiled programs in JAX's persistent cache.

JAX writes cache entries from process 0 alone (`jax._src.compiler._cache_write`: a
shared file system should not see every host write). Its keys hold the devices a
program runs on, so process 1 of a test's two processes never finds process 0's
entries and compiled every program of every multi-process test again on every run:
the warm suite's multi-process runs cost nearly what the cold ones did. With this,
`test_multiprocess.py` alone took 282 s from an empty cache and 166 s warm, against 347 s
and 268 s before (the 2-process launch of its nine cases: 69 s warm, 32 s with this; an
Intel Xeon with 2 cores, 2026-11-27). The tests' launched scripts call
`every_process_writes()` before they compile; a user's multi-process run is left as JAX
makes it. Where a JAX version has no such function, the tests run as before, only slower.

A launched process makes its own devices (`trainer.distributed.devices`), so the tests'
device count must not reach it; their other XLA options (`conftest.TEST_XLA_FLAGS`) do
(`launched_env`): it compiles as the tests do, and its programs are held equal to ones this
process compiled with the same options.
"""

import functools
import os

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def launched_env(drop: tuple[str, ...] = (), **extra: str) -> dict[str, str]:
  """This process's environment for a process that makes its own devices: `XLA_FLAGS`
  without the device count, less the variables in `drop`, plus `extra`."""
  env = {k: v for k, v in os.environ.items() if k not in drop}
  flags = [f for f in env.pop("XLA_FLAGS", "").split()
           if not f.startswith(DEVICE_COUNT_FLAG + "=")]
  if flags:
    env["XLA_FLAGS"] = " ".join(flags)
  env.update(extra)
  return env


def every_process_writes() -> None:
  from jax._src import compilation_cache, compiler, distributed

  original = getattr(compiler, "_cache_write", None)
  if original is None or getattr(original, "every_process_writes", False):
    return

  @functools.wraps(original)
  def write(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks):
    if distributed.global_state.process_id == 0 or host_callbacks:
      return original(cache_key, compile_time_secs, module_name, backend, executable,
                      host_callbacks)
    compilation_cache.put_executable_and_time(cache_key, module_name, executable, backend,
                                              int(compile_time_secs))

  write.every_process_writes = True
  compiler._cache_write = write
