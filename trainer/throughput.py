"""How fast a run uses its hardware: FLOPs per train step, device peaks, MFU.

The FLOPs of a step are XLA's count for the train step program
(`Lowered.cost_analysis()`, before optimisation, so a rematerialised model's
recomputation counts), scaled from the strategy's program to the whole step
of all models: a jit program is the global step; a pmap or shard_map program
is one device's part (`Strategy.program_is_per_device`). Per device is that
over the device count.

MFU is the achieved FLOP/s per device over the device's peak for the
compute dtype (`PEAK_TFLOPS`: dense peaks from the vendors' data sheets; on
NVIDIA float32 matmuls run as TF32 by default, so float32 takes the TF32
peak; TPUs multiply float32 in bfloat16 passes by default). On CPU the peak is
measured once with a float32 matmul (`measured_peak`); an unknown device has
none, and no MFU is reported.
"""

from __future__ import annotations

import functools
import logging
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


def peak_tflops(device: Any, compute_dtype: str) -> float | None:
  """The table's peak for `device` in `compute_dtype` ('float32', 'bfloat16', 'float16');
  on CPU the measured one; None for a device the table lacks."""
  if device.platform == "cpu":
    return measured_peak()
  kind = str(getattr(device, "device_kind", ""))
  for key in sorted(PEAK_TFLOPS, key=len, reverse=True):
    if key in kind:
      bf16, fp32 = PEAK_TFLOPS[key]
      return fp32 if compute_dtype == "float32" else bf16
  return None


@functools.cache
def measured_peak(size: int = 1024, repeats: int = 5) -> float:
  """TFLOP/s of a `size`-square float32 matmul on the first device (best of `repeats`)."""
  device = jax.local_devices()[0]
  a = jax.device_put(jnp.ones((size, size), jnp.float32), device)
  matmul = jax.jit(lambda x: x @ x)
  matmul(a).block_until_ready()
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    matmul(a).block_until_ready()
    best = min(best, time.perf_counter() - start)
  peak = 2 * size**3 / best / 1e12
  logging.info("CPU peak measured with a %d-square float32 matmul: %.3f TFLOP/s per device",
               size, peak)
  return peak


class StepFlops:
  """The FLOPs of one train step (all models, all devices), counted once on first use.

  Args:
    lower: `() -> jax.stages.Lowered` of the strategy's one-step program.
    per_device_program: the program is one device's part (pmap, shard_map).
    num_devices: the devices the step runs on.
  """

  def __init__(self, lower: Callable[[], Any], *, per_device_program: bool, num_devices: int):
    self._lower, self.per_device_program = lower, per_device_program
    self.num_devices = num_devices

  @functools.cached_property
  def total(self) -> float | None:
    try:
      analysis = self._lower().cost_analysis()
    except Exception as e:  # A backend without cost analysis: no FLOPs, no MFU.
      logging.warning("No FLOPs per step: the step's cost analysis failed (%s: %s)",
                      type(e).__name__, e)
      return None
    if isinstance(analysis, (list, tuple)):
      analysis = analysis[0] if analysis else None
    flops = (analysis or {}).get("flops")
    if not flops or flops <= 0:
      return None
    return float(flops) * (self.num_devices if self.per_device_program else 1)

  @property
  def per_device(self) -> float | None:
    return None if self.total is None else self.total / self.num_devices

  def describe(self) -> str:
    if self.total is None:
      return "FLOPs per train step: unknown (no cost analysis)"
    return (f"FLOPs per train step: {self.total / 1e9:.3f} GFLOP for all models, "
            f"{self.per_device / 1e9:.3f} GFLOP per device ({self.num_devices} devices)")
