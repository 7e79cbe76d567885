r"""A dry run: whether a layout fits, and what its train step costs, before launching.

    python -m trainer.plan --config=configs/lm.py:fsdp --devices=8 [--mesh=2x4] \
        [--device=H100 | --memory_gib=16]

    python -m trainer.plan --config=configs/mnist_sweep.py --devices=8

    python -m trainer.plan --config=configs/base.py \
        --trainer=examples/my_trainer.py:RegressionTrainer

The Trainer is the one the config names (`config.trainer`), or `--trainer`
(`path/to/file.py:Class` or `module:Class`); its module defines
`example_batch(config)`, one batch of the shapes it trains on. A pmap strategy
is planned as its jit counterpart on the same devices (`sharded_ensemble` with
one member per device, `sharded_data_parallel` over a data axis): the same
state per device, compiled by `jit`.

It builds the train state and the train step abstractly (`jax.eval_shape`, then
`lower(...).compile()` on `jax.ShapeDtypeStruct` leaves carrying the strategy's
shardings) for the given number of fake CPU devices (at LLVM's level 0:
`CPU_PLAN_COMPILER_OPTIONS`): nothing is initialised, no data is read, no step runs. It
prints per device the parameter, optimizer-state and other state bytes (from the
shardings), the compiled step's argument, temporary (activations and workspace) and
output bytes (`compiled.memory_analysis()`), its FLOPs (the matrix products of every
layer, counted in the step's trace as the run's MFU counts them,
`trainer.throughput.StepFlops`; XLA's `cost_analysis()` counts a scanned layer stack's
body once), the collectives in its HLO, and the layout of the largest parameters (with a
`stage` mesh axis, also the pipeline's schedule, its bubble fraction and which layers each stage
runs); then compares the peak with one device's memory (the `--device` row of
`trainer.throughput.MEMORY_GIB`, or `--memory_gib`) and says whether the run fits. When
it does not, it plans again with the settings that cut a step's temporaries (`remedies`:
each repeated block rematerialised on its own, blockwise attention, both) and names
each with its peak. The compiled program is the CPU backend's: a GPU or TPU compiler
fuses and schedules differently, so its temporaries are an estimate.

`make_plan(trainer, example_batch)` is the same for any Trainer.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from strategies.tree import array_bytes
from trainer.step.quantized_base import is_quantized

PyTree = Any
#: XLA:CPU's options for the dry run's compile: LLVM's optimization level 0 instead of
#: XLA's default, 3. What a plan reads (memory, FLOPs, collectives) is decided by XLA's
#: HLO passes and buffer assignment, before LLVM; the program never runs. The 16 plans of
#: the docs print the same at either level, in 0.81 of the time (`tests/test_plan.py`
#: compares one).
CPU_PLAN_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0}
#: The collective ops of an optimised HLO module, as `make_plan` counts them.
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


@dataclasses.dataclass(frozen=True)
class Plan:
  """What one device holds and runs for a train step (bytes per device, the fullest one).

  Attributes:
    params_bytes, opt_state_bytes, other_state_bytes: the train state's shards.
    argument_bytes, output_bytes, temp_bytes, alias_bytes: the compiled step's
      `memory_analysis()` (temp: activations and workspace; alias: outputs written
      over donated inputs).
    peak_bytes: argument + output - alias + temp.
    flops: the step's matrix-product FLOPs per device, every layer counted
      (`trainer.throughput.StepFlops`, what the run's MFU divides).
    xla_flops: XLA's `cost_analysis()` of the compiled program (per device; a loop's body,
      such as a scanned layer stack's, counted once).
    collectives: op name -> count in the optimised HLO.
    collective_bytes: op name -> the bytes its results hold per device, summed over its
      instructions (an instruction in a loop's body counted once, as in `collectives`).
    largest: `(path, shape, PartitionSpec, bytes on one device)` of the largest parameters.
    device_memory: the memory compared against (None: not compared).
    pipeline: the pipeline's schedule and bubble, and which layers each stage runs
      (empty without a `stage` axis).
  """

  strategy: str
  num_devices: int
  params_bytes: int
  opt_state_bytes: int
  other_state_bytes: int
  argument_bytes: int
  output_bytes: int
  temp_bytes: int
  alias_bytes: int
  flops: float
  collectives: dict[str, int]
  largest: list[tuple[str, tuple[int, ...], Any, int]]
  device_memory: int | None = None
  pipeline: tuple[str, ...] = ()
  collective_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
  #: `(rows, slots, bytes in all, bytes per device)` of a generation's key/value cache
  #: (`--generate`), or None.
  generation: tuple[int, int, int, int] | None = None
  #: `(weights, bytes per device, their bytes per device in bf16)` of a QLoRA run's quantized
  #: base (`config.lora.base_dtype`: codes and scales), or None.
  quantized: tuple[int, int, int] | None = None
  xla_flops: float = 0.0
  #: `(field, bytes per device)` in `other_state_bytes` (a preference run's `reference`).
  other_parts: tuple[tuple[str, int], ...] = ()
  #: Report lines of the Trainer's own (its `plan_notes(abstract state)`: an RL rollout's).
  notes: tuple[str, ...] = ()

  @property
  def peak_bytes(self) -> int:
    return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

  @property
  def fits(self) -> bool | None:
    return None if self.device_memory is None else self.peak_bytes <= self.device_memory

  def report(self) -> str:
    mib = lambda b: f"{b / 2**20:,.2f} MiB"  # noqa: E731
    parts = ", ".join(f"{name} {mib(b)}" for name, b in self.other_parts)
    lines = [
        f"{self.strategy} on {self.num_devices} devices; per device (the fullest one):",
        f"  parameters        {mib(self.params_bytes)}",
        f"  optimizer state   {mib(self.opt_state_bytes)}",
        f"  other state       {mib(self.other_state_bytes)}" + f" ({parts})" * bool(parts),
        f"  step arguments    {mib(self.argument_bytes)} (state and batch)",
        f"  step temporaries  {mib(self.temp_bytes)} (activations, workspace)",
        f"  step outputs      {mib(self.output_bytes)} ({mib(self.alias_bytes)} written over "
        f"donated inputs)",
        f"  peak              {mib(self.peak_bytes)}",
        f"  FLOPs per step    {self.flops:.4g} (matrix products, every layer; "
        f"{self.flops * self.num_devices:.4g} on all devices)",
        "  collectives       " + (", ".join(
            f"{n} x{c} ({mib(self.collective_bytes.get(n, 0))})"
            for n, c in self.collectives.items()) or "none"),
        *self.notes, "  largest parameters:"]
    if self.quantized:
      count, held, bf16 = self.quantized
      whole = self.params_bytes - held + bf16
      lines.insert(2, f"  quantized base    {mib(held)} ({count} weights: codes and scales), "
                   f"{held / bf16:.3f}x their {mib(bf16)} in bf16; all parameters "
                   f"{self.params_bytes / whole:.3f}x theirs with the base in bf16")
    if self.generation:
      rows, slots, total, per_device = self.generation
      lines.insert(len(lines) - 1, f"  generation cache  {mib(per_device)} ({rows} rows x "
                   f"{slots} positions; {mib(total)} in all), besides the parameters")
    if self.pipeline:
      lines[1:1] = [f"  {self.pipeline[0]}"] + [f"    {line}" for line in self.pipeline[1:]]
    for path, shape, spec, size in self.largest:
      lines.append(f"    {path} {shape} {spec} -> {mib(size)} per device")
    if self.device_memory is not None:
      verdict = "fits" if self.fits else "does NOT fit"
      lines.append(f"  {verdict}: peak {mib(self.peak_bytes)} of {mib(self.device_memory)} "
                   f"({100 * self.peak_bytes / self.device_memory:.1f}%)")
    return "\n".join(lines)


def shard_bytes(x: Any) -> int:
  """Bytes of the largest shard of an array (or `ShapeDtypeStruct`) with a sharding."""
  shape = tuple(x.shape)
  sharding = getattr(x, "sharding", None)
  if sharding is not None:
    shape = tuple(sharding.shard_shape(shape))
  return array_bytes(shape, x.dtype)  # 4-bit values at half a byte.


def _sum(tree: PyTree) -> int:
  return sum(shard_bytes(x) for x in jax.tree.leaves(tree) if hasattr(x, "shape"))


def _quantized_bytes(params: PyTree) -> tuple[int, int, int] | None:
  """(count, bytes per device, bf16 bytes per device) of the quantized weights in `params`."""
  weights = [x for x in jax.tree.leaves(params, is_leaf=is_quantized) if is_quantized(x)]
  if not weights:
    return None
  held = sum(_sum(w) for w in weights)
  codes = [jax.tree.leaves(w.array.qvalue)[0] for w in weights]
  bf16 = sum(shard_bytes(jax.ShapeDtypeStruct(c.shape, jnp.bfloat16,
                                              sharding=getattr(c, "sharding", None)))
             for c in codes)
  return len(weights), held, bf16


def count_collectives(hlo: str) -> dict[str, int]:
  """Collective op -> count in an optimised HLO module's text (async pairs counted once)."""
  counts = {op: len(re.findall(rf"\s{op}(?:-start)?\(", hlo)) for op in COLLECTIVES}
  return {op: n for op, n in counts.items() if n}


_DTYPE_BYTES = {"u4": 0.5, "s4": 0.5, "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2,
                "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
                "c128": 16}


def count_collective_bytes(hlo: str) -> dict[str, int]:
  """Collective op -> bytes of its results per device in an optimised HLO module's text (an
  async pair's start counted once, by its largest buffer: the result)."""
  totals = collections.Counter()
  pattern = re.compile(r"=\s*(\(.*?\)|\S+)\s+(" + "|".join(COLLECTIVES) + r")(-start)?\(")
  for line in hlo.splitlines():
    match = pattern.search(line)
    if not match:
      continue
    sizes = [math.prod(int(d) for d in dims.split(",") if d) * _DTYPE_BYTES.get(dtype, 4)
             for dtype, dims in re.findall(r"([a-z]+[0-9]*)\[([0-9,]*)\]", match.group(1))]
    if sizes:
      totals[match.group(2)] += int(max(sizes) if match.group(3) else sum(sizes))
  return dict(totals)


def _other_parts(state: Any) -> tuple[tuple[str, int], ...]:
  """`(field, bytes per device)` of each other field of a train state holding any."""
  sizes = {f.name: _sum(getattr(state, f.name)) for f in dataclasses.fields(state)
           if f.name not in ("params", "opt_state", "step", "rng")}
  return tuple((name, size) for name, size in sizes.items() if size)


def make_plan(trainer: Any, example_batch: dict[str, np.ndarray], *,
              device_memory: int | None = None, top: int = 5,
              generate: tuple[int, int] | None = None) -> Plan:
  """The plan of `trainer`'s train step for batches shaped like the host batch
  `example_batch` (the global batch, on one process), with nothing initialised: the
  state's leaves are `jax.ShapeDtypeStruct` objects with the strategy's shardings.
  `generate=(rows, slots)` adds the key/value cache a generation of `rows` prompts of
  `slots` positions keeps (`trainer.generation.cache_bytes`).

  Raises:
    ValueError: a pmap strategy (its step takes per-device copies; plan its jit
      counterpart), or the layout's own errors (`strategies.layout.check_layout`).
  """
  from strategies.base import cpu_compiler_options
  from strategies.tree import keypath_str

  strategy = trainer.strategy
  if strategy.name.startswith("pmap"):
    raise ValueError(f"the dry run plans jit strategies; config.strategy.name="
                     f"{strategy.name!r} steps per-device copies. Plan 'sharded_data_parallel' "
                     f"or 'sharded_ensemble' on the same devices instead.")
  abstract = strategy.checkpoint_target(trainer.states.abstract(example_batch))
  batch = strategy.put_batch(example_batch)  # One small host batch: its shapes and layout.
  lowered = trainer.compiled.train(abstract).lower(abstract, batch)
  devices = {d for x in jax.tree.leaves(batch) for d in x.sharding.device_set}
  compiled = lowered.compile(cpu_compiler_options(devices, CPU_PLAN_COMPILER_OPTIONS))
  memory = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list | tuple) else cost
  from trainer.throughput import StepFlops
  flops = StepFlops(trainer.compiled.train(abstract), lambda: (abstract, batch),
                    num_devices=strategy.num_devices).per_device
  largest = [(keypath_str(path, drop_box=True), tuple(x.shape), getattr(x.sharding, "spec", None),
              shard_bytes(x)) for path, x in jax.tree_util.tree_leaves_with_path(abstract.params)]
  largest.sort(key=lambda row: -math.prod(row[1]))
  params_bytes, opt_bytes = _sum(abstract.params), _sum(abstract.opt_state)
  pipeline = getattr(strategy, "pipeline", None)
  stages = ()
  if pipeline is not None:
    stages = (pipeline.describe(), *pipeline.layout_lines(pipeline.check_state(abstract)))
  generation = None
  if generate:
    from trainer.generation import cache_bytes
    generation = (*generate, *cache_bytes(trainer, abstract, *generate))
  return Plan(
      quantized=_quantized_bytes(abstract.params), generation=generation,
      strategy=strategy.describe(), num_devices=strategy.num_devices,
      params_bytes=params_bytes, opt_state_bytes=opt_bytes, other_parts=_other_parts(abstract),
      other_state_bytes=_sum(abstract) - params_bytes - opt_bytes,
      argument_bytes=int(memory.argument_size_in_bytes),
      output_bytes=int(memory.output_size_in_bytes), temp_bytes=int(memory.temp_size_in_bytes),
      alias_bytes=int(memory.alias_size_in_bytes), flops=float(flops or 0.0),
      xla_flops=float((cost or {}).get("flops", 0.0)),
      collectives=count_collectives(hlo := compiled.as_text()), largest=largest[:top],
      device_memory=device_memory, pipeline=stages, collective_bytes=count_collective_bytes(hlo),
      notes=tuple(getattr(trainer, "plan_notes", lambda _: ())(abstract)))


def remedies(config, model) -> list[tuple[str, dict[str, Any]]]:
  """The settings that cut a step's temporaries that `config` does not use yet, as
  `(flags, overrides)`: each repeated block rematerialised on its own (the block's class
  from the model's `REMAT_BLOCK`; remat with no modules checkpoints the whole forward pass
  as one piece, which the backward pass recomputes at once, so the peak stays), blockwise
  attention (for a model that calls `models.attention`), and both."""
  import functools
  cls = model.func if isinstance(model, functools.partial) else model
  block = getattr(cls if isinstance(cls, type) else type(cls), "REMAT_BLOCK", None)
  options = []
  if block and block not in tuple(config.remat.modules):
    options.append((f"--config.remat.policy=nothing_saveable --config.remat.modules="
                    f"'(\"{block}\",)'",
                    {"remat.policy": "nothing_saveable", "remat.modules": (block,)}))
  if config.attention.method == "plain":
    options.append(("--config.attention.method=blockwise", {"attention.method": "blockwise"}))
  if len(options) == 2:
    options.append((f"{options[0][0]} {options[1][0]}", {**options[0][1], **options[1][1]}))
  return options


def planned_remedies(trainer_cls, config, example_batch, *, model, device_memory: int,
                     peak: int) -> list[str]:
  """Each of `remedies` for `config` and its trainer's `model` planned (a Trainer built and
  its step compiled with it): a line with its peak, for those that lower `peak`."""
  import ml_collections
  lines = []
  for flags, overrides in remedies(config, model):
    other = ml_collections.ConfigDict(config.to_dict())
    other.update_from_flattened_dict(overrides)
    try:
      plan = make_plan(trainer_cls(other), example_batch(other), device_memory=device_memory)
    except ValueError:  # A setting this model or layout refuses: no advice from it.
      continue
    if plan.peak_bytes < peak:
      verdict = "fits" if plan.fits else "does NOT fit"
      lines.append(f"    {flags}: peak {plan.peak_bytes / 2**20:,.2f} MiB "
                   f"({100 * plan.peak_bytes / device_memory:.1f}%), {verdict}")
  return lines


def device_memory_bytes(device: str | None, memory_gib: float | None) -> int | None:
  """One device's memory: `memory_gib`, else the `device` row of `MEMORY_GIB`.

  Raises:
    ValueError: naming the flag and the devices the table has.
  """
  from trainer.throughput import MEMORY_GIB, table_row
  if memory_gib:
    return int(memory_gib * 2**30)
  if not device:
    return None
  gib = table_row(MEMORY_GIB, device)
  if gib is not None:
    return int(gib * 2**30)
  raise ValueError(f"--device={device!r} is not in trainer.throughput.MEMORY_GIB "
                   f"{sorted(MEMORY_GIB)}; pass --memory_gib instead.")


class PlanError(ValueError):
  """The dry run cannot build what it was asked to plan; the message says why."""


def load_trainer(spec: str) -> tuple[type, Any]:
  """The Trainer class `spec` names (`path/to/file.py:Class` or `module:Class`) and its
  module's `example_batch(config)`.

  A Trainer's file may also be a program that defines absl flags when imported (the
  examples do): those are defined aside and dropped, so they meet none of the caller's.

  Raises:
    PlanError: the file, module or class is missing, the class is no Trainer, or the
      module defines no `example_batch`.
  """
  import importlib.util  # Binds importlib too (import_module).
  import os

  from absl import flags

  from trainer.trainer import Trainer

  where, _, name = spec.rpartition(":")
  if not where or not name:
    raise PlanError(f"--trainer / config.trainer={spec!r} must be 'path/to/file.py:Class' or "
                    f"'module:Class'.")
  defined = flags.FLAGS._flags()  # noqa: SLF001  (the registry the module's DEFINEs fill)
  ours = dict(defined)
  defined.clear()
  try:
    if where.endswith(".py"):
      if not os.path.isfile(where):
        raise PlanError(f"--trainer / config.trainer={spec!r}: no file {where!r} (from "
                        f"{os.getcwd()}).")
      module_spec = importlib.util.spec_from_file_location(
          "_planned_" + os.path.splitext(os.path.basename(where))[0], where)
      module = importlib.util.module_from_spec(module_spec)
      module_spec.loader.exec_module(module)
    else:
      try:
        module = importlib.import_module(where)
      except ImportError as e:
        raise PlanError(f"--trainer / config.trainer={spec!r}: cannot import {where!r} "
                        f"({e}).") from e
  finally:
    defined.clear()
    defined.update(ours)
  cls = getattr(module, name, None)
  if not (isinstance(cls, type) and issubclass(cls, Trainer)):
    found = sorted(k for k, v in vars(module).items()
                   if isinstance(v, type) and issubclass(v, Trainer) and v is not Trainer)
    raise PlanError(f"--trainer / config.trainer={spec!r}: {where} has no Trainer subclass "
                    f"{name!r} (its Trainer classes: {found or 'none'}).")
  batch = getattr(module, "example_batch", None)
  if not callable(batch):
    raise PlanError(f"--trainer / config.trainer={spec!r}: {where} defines no "
                    f"example_batch(config), the one batch of its shapes the dry run compiles "
                    f"the step for; add one beside {name}.")
  return cls, batch


def jit_counterpart(config) -> str:
  """Turns a pmap strategy of `config` into the jit strategy with the same state per device
  (in place); returns what was changed ("" for a jit strategy)."""
  name = config.strategy.name
  if name == "pmap_ensemble":
    config.strategy.name = "sharded_ensemble"
    config.strategy.ensemble_mesh_shape = (-1, 1)  # One member per device, as under pmap.
  elif name == "pmap_data_parallel":
    config.strategy.name = "sharded_data_parallel"
    config.strategy.mesh_shape, config.strategy.mesh_axes = (-1,), ("data",)
    config.strategy.logical_axis_rules = (("batch", "data"),)
  else:
    return ""
  return (f"{name} planned as its jit counterpart {config.strategy.name} on the same devices "
          f"(the same state per device; the program is jit's)")


def _sizes(flag: str, text: str, accepted: str) -> tuple[int, ...]:
  """Sizes joined by x (`--mesh=2x4`, `--generate=8x512`).

  Raises:
    app.UsageError: naming the flag, its value and `accepted`.
  """
  from absl import app
  try:
    return tuple(int(n) for n in text.lower().split("x"))
  except ValueError:
    raise app.UsageError(f"--{flag}={text!r} must be {accepted}.") from None


def main(argv) -> None:
  from absl import app, flags

  del argv
  FLAGS = flags.FLAGS  # noqa: N806
  config = FLAGS.config
  devices_count = FLAGS.devices
  mesh = FLAGS.mesh
  if mesh:
    shape = _sizes("mesh", mesh, "sizes joined by x, e.g. 2x4")
    if len(shape) != len(config.strategy.mesh_axes):
      raise app.UsageError(f"--mesh={mesh!r} has {len(shape)} axes; the config's mesh axes are "
                           f"{tuple(config.strategy.mesh_axes)}.")
    config.strategy.mesh_shape = shape
    devices_count = devices_count or math.prod(shape)
  memory = device_memory_bytes(FLAGS.device, FLAGS.memory_gib)
  generate = None
  if FLAGS.generate:
    accepted = ("ROWSxPOSITIONS, e.g. 8x512 (prompts, and the longest prompt plus the new "
                "tokens)")
    generate = _sizes("generate", FLAGS.generate, accepted)
    if len(generate) != 2 or min(generate) < 1:
      raise app.UsageError(f"--generate={FLAGS.generate!r} must be {accepted}.")
  spec = FLAGS.trainer or config.trainer
  if not spec:
    raise app.UsageError("the config names no Trainer (config.trainer is empty): pass "
                         "--trainer=path/to/file.py:Class, e.g. "
                         "--trainer=examples/my_trainer.py:RegressionTrainer.")
  try:
    trainer_cls, example_batch = load_trainer(spec)
  except PlanError as e:
    raise app.UsageError(str(e)) from None
  note = jit_counterpart(config)
  from trainer.distributed import devices
  devices.initialize(devices_count or config.num_cpu_devices or 8)
  trainer = trainer_cls(config)
  plan = make_plan(trainer, example_batch(config), device_memory=memory, generate=generate)
  print(f"{trainer_cls.__name__} ({spec})" + (f"; {note}" if note else ""))
  print(plan.report())
  if plan.fits is False:
    if config.remat.policy and not tuple(config.remat.modules):
      print("  config.remat.modules=() checkpoints the whole forward pass as one piece: the "
            "backward pass recomputes it at once, so the peak stays; name the repeated "
            "block instead.")
    lines = planned_remedies(trainer_cls, config, example_batch, model=trainer.model,
                             device_memory=memory, peak=plan.peak_bytes)
    print("\n".join(["  what lowers the peak (each planned):", *lines]) if lines else
          "  no remat or attention setting lowers the peak: shard the state further "
          "(config.strategy.logical_axis_rules) or use more devices.")


def _define_flags():
  from absl import flags
  from ml_collections import config_flags
  config_flags.DEFINE_config_file("config", None, "A config (configs/lm.py:<layout>).")
  flags.DEFINE_string("trainer", "", "The Trainer, path/to/file.py:Class or module:Class "
                      "(default: config.trainer).")
  flags.DEFINE_integer("devices", 0, "Fake CPU devices to plan for (default: the mesh's, or 8).")
  flags.DEFINE_string("mesh", "", "The mesh shape, e.g. 2x4 (sets config.strategy.mesh_shape).")
  flags.DEFINE_string("device", "", "A device of trainer.throughput.MEMORY_GIB (e.g. H100).")
  flags.DEFINE_float("memory_gib", 0.0, "One device's memory in GiB (instead of --device).")
  flags.DEFINE_string("generate", "", "ROWSxPOSITIONS: also the key/value cache a generation "
                      "of that many prompts and positions keeps per device (trainer.generation).")
  flags.mark_flag_as_required("config")


if __name__ == "__main__":
  from trainer import config as config_lib
  _define_flags()
  config_lib.run(main, flags_parser=None)
