"""Host devices: XLA:CPU's thread pool has room for every device's collective waits.

Each case is a fresh process that makes its 8 devices through `set_num_cpu_devices`, as an
example or a benchmark does, with the environment's pool size (`PJRT_NPROC`) its own.
"""

import os
import subprocess
import sys

import pytest

from trainer.distributed import devices

#: Queues `calls` calls of one program with all-reduces over the 8 devices, none waited on
#: until the last (an evaluation's chunks, a train loop's steps). At XLA's default pool size
#: (8 threads for 8 devices) such calls deadlocked in the rendezvous and XLA aborted the
#: process. Checks each call's result, then prints the pool's threads.
QUEUED = r"""
import os, sys
from trainer.distributed import devices
devices.set_num_cpu_devices(8)
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
w = jax.device_put(jnp.full((128, 128), 1e-5), NamedSharding(mesh, P()))
x = jax.device_put(jnp.ones((8 * 32, 128)), NamedSharding(mesh, P("data")))
evaluate = jax.jit(lambda w, x: (jnp.tanh(x @ w).mean(), jnp.tanh(x @ w).max()))
calls = int(sys.argv[1])
outs = [evaluate(w, x * (i + 1)) for i in range(calls)]
# Call i's result is its own input's: every entry is tanh(128 * 1e-5 * (i + 1)), below
# tanh's saturation for 2,000 calls. float32: 128 additions (at most 128 * 2**-24, 8e-6,
# relative) and a few ulps of tanh.
expected = np.tanh(128 * 1e-5 * np.arange(1, calls + 1))
np.testing.assert_allclose(np.array(outs, np.float64), np.stack([expected] * 2, 1), rtol=1e-4)
pool = sum("XLAEigen" in open(f"/proc/self/task/{t}/comm").read()
           for t in os.listdir("/proc/self/task"))
print("calls", len(outs), "pool", pool, "PJRT_NPROC", os.environ.get("PJRT_NPROC"))
"""


def _run(calls: int, **env) -> list[str]:
  base = {k: v for k, v in os.environ.items() if k != devices.HOST_THREADS_ENV}
  run = subprocess.run([sys.executable, "-c", QUEUED, str(calls)], env={**base, **env},
                       capture_output=True, text=True, timeout=300)
  assert run.returncode == 0, run.stderr[-3000:]
  return run.stdout.split()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_queued_calls_with_collectives_finish_on_the_reserved_pool():
  words = _run(2000)
  assert words[:2] == ["calls", "2000"], words
  threads = max(os.cpu_count() or 1, devices.HOST_THREADS_PER_DEVICE * 8)
  assert words[3] == str(threads) and words[5] == str(threads), words


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_pool_size_the_environment_names_is_kept():
  words = _run(4, **{devices.HOST_THREADS_ENV: "24"})
  assert words[3] == "24" and words[5] == "24", words


def test_one_device_leaves_xlas_default(monkeypatch):
  monkeypatch.delenv(devices.HOST_THREADS_ENV, raising=False)
  devices.reserve_host_threads(1)
  assert devices.HOST_THREADS_ENV not in os.environ
  devices.reserve_host_threads(4)
  assert os.environ[devices.HOST_THREADS_ENV] == str(
      max(os.cpu_count() or 1, devices.HOST_THREADS_PER_DEVICE * 4))
