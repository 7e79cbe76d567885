"""Logical rules map annotations exactly as Flax does, and arrays really are laid out so."""

import functools

import flax.linen as nn
import pytest
from conftest import MLPTrainer, mlp_config, vector_batches
from flax import nnx
from jax.sharding import PartitionSpec as P

RULES = (("batch", "data"), ("hidden", "model"), ("embed", None), ("layer", None))


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


# -- Rule tables that cannot fail silently (strategies/layout.py) --------------------------------


def _init(**strategy):
  config = mlp_config(**{f"strategy.{k}": v for k, v in strategy.items()})
  return MLPTrainer(config).init_state(vector_batches(1, 16, config.model.embed)[0])


def test_two_rules_for_one_logical_name_are_refused():
  with pytest.raises(ValueError, match=r"two rules for 'hidden': \('hidden', 'model'\) and "
                                       r"\('hidden', None\)"):
    _init(logical_axis_rules=RULES + (("hidden", None),))


def test_a_logical_axis_no_rule_maps_is_refused_naming_the_parameters():
  with pytest.raises(ValueError, match=(
      r"axis name 'layer' in the annotation of parameter\(s\) params/layers/W1 \(2, 8, 16\), "
      r"params/layers/W2 \(2, 16, 8\), .* is neither a logical axis of "
      r"config.strategy.logical_axis_rules=.* nor a mesh axis \(the mesh's axes: \('data', "
      r"'model'\)\).* add a rule \('layer', <mesh axis>\), or \('layer', None\) to "
      r"replicate it on purpose \(unknown too: \['embed'\]\)")):
    _init(logical_axis_rules=(("batch", "data"), ("hidden", "model")))
  # A table that shards only the batch replicates every parameter on purpose.
  state = _init(logical_axis_rules=(("batch", "data"),))
  assert state.params["layers"]["W1"].value.sharding.spec == P(None, None, None)


def test_a_rule_that_matches_no_parameter_warns_naming_it():
  with pytest.warns(UserWarning, match=r"the rule\(s\) \('vocab', 'model'\) match no "
                                       r"parameter"):
    _init(logical_axis_rules=RULES + (("vocab", "model"),))


def test_a_large_parameter_replicated_over_a_model_axis_is_refused():
  replicated = (("batch", "data"), ("hidden", None), ("embed", None), ("layer", None))
  with pytest.raises(ValueError, match=(
      r"parameter 'params/layers/W1' \(2, 8, 16\) \(0.000977 MiB, annotated \('layer', "
      r"'embed', 'hidden'\)\) is replicated over model axis 'model' \(size 4\) .* above "
      r"config.strategy.max_replicated_mb=0.0005")):
    _init(logical_axis_rules=replicated, max_replicated_mb=0.0005)
  _init(logical_axis_rules=replicated, max_replicated_mb=0)  # No limit.
  _init(logical_axis_rules=RULES, max_replicated_mb=0.0005)  # Sharded over 'model'.


class MeshNamedDense(nn.Module):
  """A Linen layer annotated with mesh axes (`nn.with_partitioning`), not logical names."""

  @nn.compact
  def __call__(self, x):
    kernel = self.param("kernel", nn.with_partitioning(nn.initializers.lecun_normal(),
                                                       (None, "model")), (x.shape[-1], 16))
    return x @ kernel


def test_an_annotation_that_names_a_mesh_axis_is_laid_out_as_written():
  from trainer import Trainer

  class MeshNamedTrainer(Trainer):
    def build_model(self):
      return MeshNamedDense()

    def loss(self, outputs, batch):
      return ((outputs[:, :8] - batch["targets"]) ** 2).mean(-1)

  config = mlp_config(**{"strategy.logical_axis_rules": (("batch", "data"),)})
  trainer = MeshNamedTrainer(config)
  batches = vector_batches(2, 16, 8)
  state = trainer.fit(batches, num_steps=2).state
  kernel = state.params["kernel"].value
  assert kernel.sharding.spec == P(None, "model")
  assert {s.data.shape for s in kernel.addressable_shards} == {(8, 4)}


class MisspeltNnx(nnx.Module):
  """Two NNX layers annotated with mesh `PartitionSpec`s, the second misspelt ('modle');
  without `correct`, only the misspelt one."""

  def __init__(self, *, rngs: nnx.Rngs, correct: bool = True):
    init = nnx.initializers.lecun_normal()
    self.up = nnx.Linear(8, 16, kernel_init=nnx.with_partitioning(
        init, P(None, "model" if correct else "modle")), rngs=rngs)
    self.down = nnx.Linear(16, 8, kernel_init=nnx.with_partitioning(init, P("modle", None)),
                           rngs=rngs)

  def __call__(self, x):
    return self.down(nnx.relu(self.up(x)))


class MisspeltLinen(nn.Module):
  @nn.compact
  def __call__(self, x):
    kernel = self.param("kernel", nn.with_partitioning(nn.initializers.lecun_normal(),
                                                       (None, "modle")), (x.shape[-1], 8))
    return x @ kernel


@pytest.mark.parametrize("axis_types", ["auto", "explicit"])
@pytest.mark.parametrize("model", ["nnx", "nnx_alone", "linen"])
@pytest.mark.parametrize("rules", ["batch_only", "sharding"])
def test_a_misspelt_mesh_axis_in_an_annotation_is_refused_under_every_table(axis_types, model,
                                                                            rules):
  from trainer import Trainer

  class Misspelt(Trainer):
    def build_model(self):
      if model == "linen":
        return MisspeltLinen()
      return functools.partial(MisspeltNnx, correct=model == "nnx")

    def loss(self, outputs, batch):
      return ((outputs - batch["targets"]) ** 2).mean(-1)

  table = {"batch_only": (("batch", "data"),),
           "sharding": (("batch", "data"), ("hidden", "model"))}[rules]
  config = mlp_config(**{"strategy.logical_axis_rules": table,
                         "strategy.axis_types": axis_types})
  message = (r"axis name 'modle' in the annotation of parameter\(s\) params/down/kernel .* "
             r"nor a mesh axis \(the mesh's axes: \('data', 'model'\)\)")
  if model == "linen":  # Linen's Partitioned box constrains the init to it: jax refuses there.
    message = (r"Resource axis: modle of P\(None, 'modle'\) is not found in mesh: "
               r"\('data', 'model'\)")
  with pytest.raises(ValueError, match=message):
    Misspelt(config).fit(vector_batches(1, 16, 8), num_steps=1)
