"""Logical rules map annotations exactly as Flax does, and arrays really are laid out so."""

import flax.linen as nn
import pytest
from conftest import MLPTrainer, mlp_config, vector_batches
from jax.sharding import PartitionSpec as P

RULES = (("batch", "data"), ("hidden", "model"))


@pytest.fixture(scope="module")
def sharded_mlp():
  config = mlp_config(**{"strategy.logical_axis_rules": RULES})
  trainer = MLPTrainer(config)
  batches = vector_batches(3, 16, config.model.embed)
  state = trainer.init_state(batches[0])
  return trainer, state, batches


def _weights(state):
  """W1 and W2 boxes of params and of Adam's mu and nu."""
  adam = state.opt_state[0]
  trees = {"params": state.params, "mu": adam.mu, "nu": adam.nu}
  return {(name, w): tree["layers"][w] for name, tree in trees.items() for w in ("W1", "W2")}


def test_logical_annotations_include_the_scan_axis(sharded_mlp):
  _, state, _ = sharded_mlp
  specs = nn.get_partition_spec(state.params)["layers"]
  assert specs["W1"] == P("layer", "embed", "hidden")
  assert specs["W2"] == P("layer", "hidden", "embed")


@pytest.mark.parametrize("after_steps", [0, 2])
def test_params_and_adam_moments_follow_the_rules(sharded_mlp, after_steps):
  trainer, state, batches = sharded_mlp
  if after_steps:
    state = trainer.fit(batches, num_steps=after_steps, state=state).state
  expected = {"W1": P(None, None, "model"), "W2": P(None, "model", None)}
  layers, embed, depth = (trainer.config.model.num_layers, trainer.config.model.embed,
                          trainer.config.model.depth)
  shard_shape = {"W1": (layers, embed, depth // 4), "W2": (layers, depth // 4, embed)}
  for (tree, w), box in _weights(state).items():
    assert nn.logical_to_mesh(nn.get_partition_spec(box), RULES) == expected[w], (tree, w)
    array = box.value
    assert array.sharding.spec == expected[w], (tree, w)
    assert len(array.addressable_shards) == 8
    for shard in array.addressable_shards:
      assert shard.data.shape == shard_shape[w], (tree, w, shard.device)
    # The 'model' axis splits the array 4 ways; the 'data' axis replicates it twice.
    distinct = {str(s.index) for s in array.addressable_shards}
    assert len(distinct) == 4, (tree, w)


def test_batch_is_sharded_over_the_data_axis(sharded_mlp):
  trainer, _, batches = sharded_mlp
  placed = trainer.strategy.put_batch(batches[0])
  assert placed["inputs"].sharding.spec == P("data")
  assert {s.data.shape for s in placed["inputs"].addressable_shards} == {(8, 8)}
