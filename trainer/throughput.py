"""How fast a run uses its hardware: FLOPs per train step, device peaks, MFU.

The FLOPs of a step are its matrix products' (`dot_general` and convolutions,
2 per multiply-add: the convention of MFU figures), counted in the jaxpr of
the strategy's compiled step: a `scan` body times its length (XLA's own cost
analysis counts a loop body once, so a model of scanned layers would show
one layer), a `shard_map` or pmap body times its devices, a rematerialised
block's recomputation included. That is the step of all models on all
devices; per device is that over the device count. A `while` loop's body
counts once (its trip count is not known).

MFU is the achieved FLOP/s per device over the device's peak for the
compute dtype (`PEAK_TFLOPS`: dense peaks from the vendors' data sheets; on
NVIDIA float32 matmuls run as TF32 by default, so float32 takes the TF32
peak; TPUs multiply float32 in bfloat16 passes by default). On CPU the peak is
measured once with a float32 matmul (`measured_peak`, what `benchmarks/lm_mfu.py`
quotes); an unknown device has none, and no MFU is reported. A run's log reports
TFLOP/s and MFU on an accelerator only (`reports_flops`): a CPU's measured peak is no
data-sheet figure, and the run would pay for measuring it.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

#: device_kind (a substring of it, the longest that matches) -> (bfloat16, float32) dense
#: peak TFLOP/s per chip.
PEAK_TFLOPS = {
    "H100 NVL": (835.0, 417.5),
    "H100 PCIe": (756.5, 378.0),
    "H100": (989.4, 494.7),  # SXM (device_kind "NVIDIA H100 80GB HBM3").
    "H200": (989.4, 494.7),
    "H800": (989.4, 494.7),
    "GH200": (989.4, 494.7),
    "B200": (2250.0, 1100.0),
    "A100": (312.0, 156.0),
    "A800": (312.0, 156.0),
    "L40S": (362.0, 183.0),
    "L4": (121.0, 60.0),
    "A10G": (70.0, 35.0),
    "V100": (125.0, 15.7),  # No bfloat16 tensor cores: float16's peak.
    "TPU v6 lite": (918.0, 918.0),
    "TPU v5p": (459.0, 459.0),
    "TPU v5 lite": (197.0, 197.0),
    "TPU v5": (459.0, 459.0),
    "TPU v4": (275.0, 275.0),
    "TPU v3": (123.0, 123.0),
    "TPU v2": (45.0, 45.0),
}


#: device_kind (a substring of it, the longest that matches) -> memory per chip in GiB
#: (the vendors' data sheets), which `python -m trainer.plan` compares a layout's peak with.
MEMORY_GIB = {
    "H100 NVL": 94.0,
    "H100": 80.0,
    "H200": 141.0,
    "H800": 80.0,
    "GH200": 96.0,
    "B200": 192.0,
    "A100": 80.0,  # The 40 GB part: pass --memory_gib=40.
    "A800": 80.0,
    "L40S": 48.0,
    "L4": 24.0,
    "A10G": 24.0,
    "V100": 32.0,
    "TPU v6 lite": 32.0,
    "TPU v5p": 95.0,
    "TPU v5 lite": 16.0,
    "TPU v4": 32.0,
    "TPU v3": 32.0,
    "TPU v2": 16.0,
}


def peak_tflops(device: Any, compute_dtype: str) -> float | None:
  """The table's peak for `device` in `compute_dtype` ('float32', 'bfloat16', 'float16');
  on CPU the measured one; None for a device the table lacks."""
  if device.platform == "cpu":
    return measured_peak()
  row = table_row(PEAK_TFLOPS, str(getattr(device, "device_kind", "")))
  if row is None:
    return None
  bf16, fp32 = row
  return fp32 if compute_dtype == "float32" else bf16


def reports_flops(device: Any) -> bool:
  """Whether a run's log reports `train/tflops_per_device` and `train/mfu` on `device`: on an
  accelerator, not on CPU."""
  return device.platform != "cpu"


def table_row(table: dict[str, Any], device_kind: str) -> Any:
  """The row of a per-device table (`PEAK_TFLOPS`, `MEMORY_GIB`) whose key is the longest
  that `device_kind` contains, ignoring case; None if none is."""
  for key in sorted(table, key=len, reverse=True):
    if key.lower() in device_kind.lower():
      return table[key]
  return None


def matmul_tflops(size: int, dtype: Any = jnp.float32, repeats: int = 5,
                  device: Any = None) -> float:
  """TFLOP/s of a `size`-square matmul in `dtype` on `device` (the first local one): the
  best of `repeats` timed calls after a warm-up."""
  a = jax.device_put(jnp.ones((size, size), dtype), device or jax.local_devices()[0])
  matmul = jax.jit(lambda x: x @ x)
  matmul(a).block_until_ready()
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    matmul(a).block_until_ready()
    best = min(best, time.perf_counter() - start)
  return 2 * size**3 / best / 1e12


@functools.cache
def measured_peak(size: int = 1024) -> float:
  """The CPU's peak: `matmul_tflops` of a `size`-square float32 matmul, measured once."""
  peak = matmul_tflops(size)
  logging.info("CPU peak measured with a %d-square float32 matmul: %.3f TFLOP/s per device",
               size, peak)
  return peak


def _dot_flops(eqn) -> float:
  lhs, rhs = (v.aval.shape for v in eqn.invars[:2])
  (_, rhs_contract), (_, rhs_batch) = eqn.params["dimension_numbers"]
  free = [d for i, d in enumerate(rhs) if i not in rhs_contract and i not in rhs_batch]
  return 2.0 * math.prod(lhs) * math.prod(free)


def _conv_flops(eqn) -> float:
  out = eqn.outvars[0].aval.shape
  rhs = eqn.invars[1].aval.shape
  out_features = rhs[eqn.params["dimension_numbers"].rhs_spec[0]]
  return 2.0 * math.prod(out) * math.prod(rhs) / out_features


def _sub_jaxprs(eqn) -> list:
  subs = []
  for value in eqn.params.values():
    for v in (value if isinstance(value, (list, tuple)) else (value,)):
      if hasattr(v, "eqns"):
        subs.append(v)
      elif hasattr(v, "jaxpr") and hasattr(v.jaxpr, "eqns"):
        subs.append(v.jaxpr)
  return subs


def jaxpr_flops(jaxpr) -> float:
  """The matrix-product FLOPs of a jaxpr (see the module docstring)."""
  total = 0.0
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name == "dot_general":
      total += _dot_flops(eqn)
    elif name == "conv_general_dilated":
      total += _conv_flops(eqn)
    elif name == "cond":
      total += max((jaxpr_flops(b.jaxpr) for b in eqn.params["branches"]), default=0.0)
    else:
      inner = sum(jaxpr_flops(sub) for sub in _sub_jaxprs(eqn))
      if name == "scan":
        inner *= eqn.params["length"]
      elif name == "shard_map":
        inner *= math.prod(eqn.params["mesh"].shape.values())
      elif name == "xla_pmap":
        inner *= eqn.params["axis_size"]
      total += inner
  return total


class StepFlops:
  """The FLOPs of one train step (all models, all devices), counted once on first use.

  Args:
    step: the strategy's compiled one-step function.
    args: `() -> (state, batch)` it is called with (abstract or placed), made only
      when the FLOPs are first asked for.
    num_devices: the devices the step runs on.
  """

  def __init__(self, step: Callable, args: Callable[[], tuple], *, num_devices: int):
    self._step, self._args, self.num_devices = step, args, num_devices

  @functools.cached_property
  def total(self) -> float | None:
    try:
      args = self._args()
      trace = getattr(self._step, "trace", None)  # A jitted function's (in its mesh).
      jaxpr = (trace(*args).jaxpr if trace is not None
               else jax.make_jaxpr(self._step)(*args))
      flops = jaxpr_flops(jaxpr.jaxpr)
    except Exception as e:  # Counting must never stop a run.
      logging.warning("No FLOPs per step: tracing the step for them failed (%s: %s)",
                      type(e).__name__, e)
      return None
    return flops or None

  @property
  def per_device(self) -> float | None:
    return None if self.total is None else self.total / self.num_devices

  def describe(self) -> str:
    if self.total is None:
      return "FLOPs per train step: unknown"
    return (f"FLOPs per train step (matrix products): {self.total / 1e9:.3f} GFLOP for all "
            f"models, {self.per_device / 1e9:.3f} GFLOP per device ({self.num_devices} "
            f"devices)")
