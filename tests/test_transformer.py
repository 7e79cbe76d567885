"""The transformer LM under every rule-table layout, what each layout holds per device,
and the collectives in the compiled train steps (HLO)."""

import itertools
import re

import jax
import numerics
import numpy as np
import pytest
from conftest import CNNTrainer, cnn_config, image_batches
from jax.sharding import PartitionSpec
from small_configs import tiny_lm_config

from configs import lm
from strategies.summary import bytes_per_device, summarize, total_bytes
from trainer.language_model import LanguageModelTrainer, synthetic_token_batches

STEPS = 4
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")


_config = tiny_lm_config


def _batches(config, num=STEPS + 1):
  return list(itertools.islice(synthetic_token_batches(
      config.seed, config.batch_size, config.seq_len, config.model.vocab_size), num))


@pytest.fixture(scope="module")
def reference():
  config = _config(**{"strategy.name": "single_device"})
  trainer = LanguageModelTrainer(config)
  batches = _batches(config)
  state = trainer.fit(batches[:STEPS], num_steps=STEPS).state
  chaos = numerics.chaos_fits(trainer, batches[:STEPS], num_steps=STEPS, view=lambda state:
                              jax.device_get(state.params))
  return jax.device_get(state.params), trainer.evaluate(state, batches[STEPS:]), chaos


# The expert layouts train a mixture of experts: tests/test_moe.py.
@pytest.mark.parametrize("layout", [name for name in lm.LAYOUTS
                                    if name not in (*lm.PIPELINES, *lm.EXPERT_LAYOUTS)])
def test_every_layout_trains_like_a_single_device(layout, reference):
  config = _config(layout)
  trainer = LanguageModelTrainer(config)
  batches = _batches(config)
  state = trainer.fit(batches[:STEPS], num_steps=STEPS).state
  want_params, want_eval, chaos = reference
  got_eval = trainer.evaluate(state, batches[STEPS:])
  np.testing.assert_allclose(got_eval["loss"], want_eval["loss"], rtol=1e-5)
  numerics.assert_equivalent(jax.device_get(state.params), want_params, chaos)


def test_the_language_model_learns_the_synthetic_stream():
  config = _config(**{"strategy.name": "single_device"})
  trainer = LanguageModelTrainer(config)
  batches = _batches(config, 81)
  before = trainer.evaluate(trainer.init_state(batches[0]), batches[80:])["loss"]
  after = trainer.evaluate(trainer.fit(batches[:80], num_steps=80).state, batches[80:])["loss"]
  assert before > 0.9 * np.log(config.model.vocab_size)
  assert after < 0.5 * before, (before, after)


def _state(layout):
  config = _config(layout)
  trainer = LanguageModelTrainer(config)
  batches = _batches(config, 1)
  return trainer, trainer.init_state(batches[0]), batches[0]


def _unsharded_bytes(tree):
  return sum(x.nbytes for x in jax.tree.leaves(tree)
             if all(a is None for a in x.sharding.spec))


def test_fsdp_holds_an_eighth_of_params_and_optimizer_state_per_device():
  _, state, _ = _state("fsdp")
  held = (state.params, state.opt_state)
  total = total_bytes(held)
  fullest = max(bytes_per_device(held).values())
  leftovers = _unsharded_bytes(held)
  print(f"FSDP x8: {fullest} of {total} bytes per device = 1/{total / fullest:.2f}")
  assert fullest <= total / 8 + leftovers
  assert fullest < total / 4  # Far from replicated.
  # The weights really are split over the data axis.
  assert state.params["blocks"]["wi"]["kernel"].value.sharding.spec == PartitionSpec(
      None, "data", None)


def test_tensor_parallel_holds_a_quarter_of_the_sharded_weights_per_device():
  _, state, _ = _state("data_tensor")  # 2 x 4: tensor parallel over 4.
  held = jax.tree.leaves((state.params, state.opt_state))
  sharded = [x for x in held if "model" in jax.tree.leaves(tuple(x.sharding.spec))]
  assert sharded
  total = total_bytes(sharded)
  fullest = max(bytes_per_device(sharded).values())
  print(f"tensor parallel x4: {fullest} of {total} sharded-weight bytes per device = "
        f"1/{total / fullest:.2f}")
  assert fullest == pytest.approx(total / 4)


def test_summary_shows_mesh_specs_and_bytes_per_device():
  trainer, state, _ = _state("fsdp_tensor")
  text = summarize(trainer.strategy, state)
  assert "mesh (data=2, model=4)" in text
  row = next(line for line in text.splitlines() if "blocks/wi/kernel" in line)
  assert "(2, 32, 64)" in row and "PartitionSpec(None, 'data', 'model')" in row.replace(
      "P(", "PartitionSpec(")
  assert re.search(r"params: .* for the model, at most .* on one device \(1/[0-9.]+ of", text)


def _collectives(hlo):
  return {c: len(re.findall(rf"\b{c}(-start)?\(", hlo)) for c in COLLECTIVES}


def test_data_parallel_step_all_reduces_gradients_and_gathers_nothing():
  trainer, state, batch = _state("data_parallel")
  hlo = trainer.compiled.train_text(state, batch)
  found = _collectives(hlo)
  assert found["all-reduce"] > 0 and found["all-gather"] == 0, found
  # The all-reduce inside the scanned layers carries each layer's whole MLP
  # kernel gradient, [embed, mlp] = [32, 64]: nothing is sharded.
  reduced = [line for line in hlo.splitlines()
             if re.search(r"= \(.*\) all-reduce(-start)?\(", line)]
  assert any("f32[32,64]" in line.split(" all-reduce")[0] for line in reduced), reduced


def test_fsdp_step_gathers_parameters_and_reduce_scatters_gradients():
  trainer, state, batch = _state("fsdp")
  hlo = trainer.compiled.train_text(state, batch)
  found = _collectives(hlo)
  assert found["all-gather"] > 0, found  # Parameters gathered for use.
  if jax.devices()[0].platform == "cpu":
    # XLA:CPU has no reduce-scatter pass: the partitioner's reduce-scatter is an
    # all-reduce whose result each device slices to its own shard.
    assert found["reduce-scatter"] > 0 or (found["all-reduce"] > 0 and "dynamic-slice" in hlo)
  else:
    assert found["reduce-scatter"] > 0, found


def test_ensemble_train_step_has_no_collective_across_members():
  trainer = CNNTrainer(cnn_config(**{"strategy.name": "sharded_ensemble", "ensemble_size": 8}))
  batch = image_batches(1, 16)[0]
  hlo = trainer.compiled.train_text(trainer.init_state(batch), batch)
  assert not any(_collectives(hlo).values()), _collectives(hlo)

  # With data parallelism inside members, collectives stay within one member's devices.
  trainer = CNNTrainer(cnn_config(**{"strategy.name": "sharded_ensemble", "ensemble_size": 8,
                                     "strategy.ensemble_mesh_shape": (4, 2)}))
  hlo = trainer.compiled.train_text(trainer.init_state(batch), batch)
  members_devices = [{d.id for d in row} for row in trainer.strategy.mesh.devices]
  groups = re.findall(r"replica_groups=\{(\{[0-9,{}]*\})\}", hlo)
  assert groups
  for group_list in groups:
    for group in re.findall(r"\{([0-9,]+)\}", group_list):
      ids = {int(i) for i in group.split(",")}
      assert any(ids <= row for row in members_devices), (ids, members_devices)


def test_rules_mapping_two_axes_of_one_parameter_to_one_mesh_axis_are_rejected():
  config = _config("fsdp", **{"strategy.logical_axis_rules": (
      ("batch", "data"), ("embed", "data"), ("mlp", "data"))})
  trainer = LanguageModelTrainer(config)
  with pytest.raises(ValueError, match=(
      r"maps logical axes 'embed' and 'mlp' of parameter 'params/blocks/wi/kernel' .*"
      r"same mesh axis 'data'")):
    trainer.init_state(_batches(config, 1)[0])
