"""The dry run (`trainer/plan.py`): byte counts that agree with the compiled program and the
placed state, and a verdict on whether a layout fits a stated memory."""

import jax
import pytest
from small_configs import tiny_lm_config

from trainer import LanguageModelTrainer
from trainer.language_model import synthetic_token_batches
from trainer.plan import device_memory_bytes, make_plan, shard_bytes


def _plan(layout, **kwargs):
  config = tiny_lm_config(layout)
  trainer = LanguageModelTrainer(config)
  batch = next(synthetic_token_batches(0, config.batch_size, config.seq_len,
                                       config.model.vocab_size))
  return trainer, batch, make_plan(trainer, batch, **kwargs)


@pytest.fixture(scope="module")
def plans():
  return {layout: _plan(layout) for layout in ("data_parallel", "fsdp")}


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
