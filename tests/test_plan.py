"""The dry run (`trainer/plan.py`): byte counts that agree with the compiled program and the
placed state, and a verdict on whether a layout fits a stated memory."""

import re

import jax
import numpy as np
import pytest
from conftest import xla_flags_naming_no_level
from small_configs import tiny_lm_config

from strategies import base
from trainer import LanguageModelTrainer
from trainer.language_model import synthetic_token_batches
from trainer.plan import (
  CPU_PLAN_COMPILER_OPTIONS,
  count_collectives,
  device_memory_bytes,
  make_plan,
  shard_bytes,
)


def _plan(layout, **kwargs):
  config = tiny_lm_config(layout)
  trainer = LanguageModelTrainer(config)
  batch = next(synthetic_token_batches(0, config.batch_size, config.seq_len,
                                       config.model.vocab_size))
  return trainer, batch, make_plan(trainer, batch, **kwargs)


#: What each plan of the `plans` fixture asked `strategies.base.cpu_compiler_options` for:
#: (devices, options, the options it got), by layout.
COMPILER_OPTIONS_ASKED = {}


@pytest.fixture(scope="module")
def plans():
  out, real = {}, base.cpu_compiler_options
  for layout in ("data_parallel", "fsdp"):
    asked = COMPILER_OPTIONS_ASKED.setdefault(layout, [])

    def spy(devices, options, asked=asked):
      got = real(devices, options)
      asked.append((set(devices), options, got))
      return got

    with pytest.MonkeyPatch.context() as patch:
      patch.setattr(base, "cpu_compiler_options", spy)
      patch.setenv("XLA_FLAGS", xla_flags_naming_no_level())  # The product's level, 0.
      out[layout] = _plan(layout)
  return out


@pytest.mark.parametrize("layout", ["data_parallel", "fsdp"])
def test_the_plans_bytes_are_the_placed_states_and_the_compiled_arguments(plans, layout):
  trainer, batch, plan = plans[layout]
  state = trainer.init_state(batch)  # Placed for real only here, to compare.
  fullest = sum(max(s.data.nbytes for s in x.addressable_shards) for x in jax.tree.leaves(state))
  assert plan.params_bytes + plan.opt_state_bytes + plan.other_state_bytes == fullest
  placed_batch = sum(shard_bytes(x) for x in jax.tree.leaves(trainer.strategy.put_batch(batch)))
  assert plan.argument_bytes == fullest + placed_batch
  assert plan.alias_bytes == fullest  # The state is donated and written over.
  assert plan.temp_bytes > 0 and plan.flops > 0
  assert plan.peak_bytes == plan.argument_bytes + plan.output_bytes - plan.alias_bytes + \
      plan.temp_bytes


def test_the_plan_compiled_at_llvm_level_0_reads_as_the_program_at_xlas_defaults(plans):
  """The dry run compiles at LLVM's level 0 on a CPU (`CPU_PLAN_COMPILER_OPTIONS`): its
  figures are XLA's HLO passes' and buffer assignment's, the same as at XLA's level 3."""
  trainer, batch, plan = plans["fsdp"]
  # The options make_plan compiled with, for the devices its placed batch is on.
  assert COMPILER_OPTIONS_ASKED["fsdp"][-1] == (
      set(jax.devices()), CPU_PLAN_COMPILER_OPTIONS, {"xla_backend_optimization_level": 0})
  abstract = trainer.strategy.checkpoint_target(trainer.states.abstract(batch))
  placed = trainer.strategy.put_batch(batch)
  default = trainer.compiled.train(abstract).lower(abstract, placed).compile(
      {"xla_backend_optimization_level": 3})
  memory = default.memory_analysis()
  assert (plan.argument_bytes, plan.output_bytes, plan.temp_bytes, plan.alias_bytes) == (
      memory.argument_size_in_bytes, memory.output_size_in_bytes,
      memory.temp_size_in_bytes, memory.alias_size_in_bytes)
  cost = default.cost_analysis()
  assert plan.xla_flops == (cost[0] if isinstance(cost, list | tuple) else cost)["flops"]
  assert plan.collectives == count_collectives(default.as_text())


def test_fsdp_holds_an_eighth_and_gathers_while_data_parallel_all_reduces(plans):
  dp, fsdp = plans["data_parallel"][2], plans["fsdp"][2]
  assert fsdp.params_bytes * 8 <= dp.params_bytes * 1.1
  assert "all-gather" in fsdp.collectives and "all-gather" not in dp.collectives
  assert "all-reduce" in dp.collectives
  name, shape, spec, size = fsdp.largest[0]
  assert "data" in tuple(spec) and size * 8 == shape[0] * shape[1] * shape[2] * 4


def test_it_catches_a_layout_that_does_not_fit_a_stated_memory(plans):
  dp, fsdp = plans["data_parallel"][2], plans["fsdp"][2]
  between = (dp.peak_bytes + fsdp.peak_bytes) // 2
  assert fsdp.peak_bytes < between < dp.peak_bytes
  trainer, batch, _ = plans["data_parallel"]
  verdict = make_plan(trainer, batch, device_memory=between)
  assert verdict.fits is False and "does NOT fit: peak" in verdict.report()
  trainer, batch, _ = plans["fsdp"]
  assert make_plan(trainer, batch, device_memory=between).fits is True


def test_a_device_name_gives_its_memory_and_an_unknown_one_is_refused():
  assert device_memory_bytes("NVIDIA H100 80GB HBM3", None) == 80 * 2**30
  assert device_memory_bytes("H200", None) == 141 * 2**30
  assert device_memory_bytes(None, 12.5) == int(12.5 * 2**30)
  with pytest.raises(ValueError, match=r"--device='Z80' is not in trainer.throughput.MEMORY_GIB"):
    device_memory_bytes("Z80", None)


# -- Any Trainer: the one a config names, or --trainer ------------------------------------------


def _mnist_plan(config_module, **overrides):
  import importlib

  from trainer.plan import jit_counterpart, load_trainer
  config = importlib.import_module(f"configs.{config_module}").get_config()
  config.batch_size = 16
  config.update_from_flattened_dict(overrides)
  trainer_cls, example_batch = load_trainer(config.trainer)
  note = jit_counterpart(config)
  return note, make_plan(trainer_cls(config), example_batch(config))


def test_the_mnist_ensemble_and_a_sweep_of_16_are_planned_per_device():
  from absl import flags
  before = set(flags.FLAGS)
  note, ensemble = _mnist_plan("mnist_ensemble")  # pmap_ensemble: one member per device.
  assert set(flags.FLAGS) == before  # The example's own flags were set aside.
  assert note.startswith("pmap_ensemble planned as its jit counterpart sharded_ensemble")
  one_cnn = 4 * (3 * 3 * 32 + 32 + 3 * 3 * 32 * 64 + 64 + 3136 * 256 + 256 + 256 * 10 + 10)
  assert ensemble.params_bytes == one_cnn  # models.CNN: one member's parameters a device.
  note, sweep = _mnist_plan("mnist_sweep")  # 16 members over 8 devices: 2 each.
  assert note == "" and sweep.params_bytes == 2 * one_cnn
  assert sweep.temp_bytes > ensemble.temp_bytes


def test_a_trainer_the_dry_run_cannot_build_is_refused_with_the_reason(tmp_path):
  from absl import flags

  from trainer.plan import PlanError, load_trainer
  with pytest.raises(PlanError, match=r"must be 'path/to/file.py:Class' or 'module:Class'"):
    load_trainer("examples/my_trainer.py")
  with pytest.raises(PlanError, match=r"no file 'nowhere.py'"):
    load_trainer("nowhere.py:T")
  with pytest.raises(PlanError, match=r"has no Trainer subclass 'Nope' \(its Trainer classes: "
                                      r"\['RegressionTrainer'\]\)"):
    load_trainer("examples/my_trainer.py:Nope")
  program = tmp_path / "program.py"
  program.write_text("from absl import flags\nfrom trainer import Trainer\n"
                     "flags.DEFINE_string('config', None, 'clashes with the caller')\n"
                     "class Mine(Trainer):\n  pass\n")
  before = set(flags.FLAGS)
  with pytest.raises(PlanError, match=r"defines no example_batch\(config\)"):
    load_trainer(f"{program}:Mine")
  assert set(flags.FLAGS) == before
  cls, batch = load_trainer("trainer.language_model:LanguageModelTrainer")
  assert cls is LanguageModelTrainer and callable(batch)


@pytest.mark.parametrize("layers", [2, 8])
def test_the_flops_per_step_count_every_layer_as_6nt_plus_attention(layers):
  """`configs/lm.py:fsdp` on 8 devices: the plan's FLOPs are the matrix products of every
  layer, 6 N T (N the weights of the products, T the batch's tokens) plus attention's
  scores and weighted sums, 12 B L^2 H D a layer, counted by hand (XLA's cost analysis
  counts the scanned stack's body once: it barely moves with the layer count)."""
  from configs import lm
  config = lm.get_config("fsdp")
  config.model.num_layers = layers
  trainer = LanguageModelTrainer(config)
  tokens = np.zeros((config.batch_size, config.seq_len), np.int32)
  plan = make_plan(trainer, {"inputs": tokens, "targets": tokens})
  m = config.model
  e, h, d, f, v = m.embed_dim, m.num_heads, m.head_dim, m.mlp_dim, m.vocab_size
  b, length = config.batch_size, config.seq_len
  n = layers * (e * 3 * h * d + h * d * e + 2 * e * f) + e * v  # qkv, out, MLP; the head.
  expected = 6 * n * b * length + layers * 12 * b * length**2 * h * d
  assert plan.flops * plan.num_devices == pytest.approx(expected, rel=1e-9)
  assert plan.xla_flops < plan.flops  # A loop's body once, per device.


def test_a_plan_that_does_not_fit_names_the_remat_and_attention_that_would_help():
  """The LM at 256 tokens a row: per-block remat and blockwise attention, each planned,
  lower the peak; both together fit a memory the plain step does not."""
  from trainer.plan import planned_remedies, remedies
  config = tiny_lm_config("data_parallel", **{"seq_len": 256, "model.max_len": 256,
                                               "model.num_layers": 4})
  trainer = LanguageModelTrainer(config)
  tokens = np.zeros((config.batch_size, config.seq_len), np.int32)
  batch = lambda config: {"inputs": tokens, "targets": tokens}  # noqa: E731
  plain = make_plan(trainer, batch(config))
  flags = [f for f, _ in remedies(config, trainer.model)]
  assert flags[0] == ("--config.remat.policy=nothing_saveable "
                      "--config.remat.modules='(\"DecoderBlock\",)'")
  assert flags[1] == "--config.attention.method=blockwise" and len(flags) == 3
  both = config.copy_and_resolve_references()
  both.update_from_flattened_dict(remedies(config, trainer.model)[2][1])
  best = make_plan(LanguageModelTrainer(both), batch(both)).peak_bytes
  memory = (best + plain.peak_bytes) // 2
  lines = planned_remedies(LanguageModelTrainer, config, batch, model=trainer.model,
                           device_memory=memory, peak=plain.peak_bytes)
  assert len(lines) == 3 and lines[2].startswith(f"    {flags[2]}: peak ")
  assert lines[2].endswith(", fits")  # Each one alone lowers the peak (else no line).
  assert all(re.search(r"peak [\d,.]+ MiB \([\d.]+%\)", line) for line in lines)
