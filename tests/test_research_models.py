"""Researchers' models through hooks alone: model state, modes, several inputs, RNG streams, NNX.

The models (tests/user_models.py) are written the way the Flax examples write
them. Equivalences, as for the CNN and the MLP:
- BatchNorm statistics are over the global batch under data parallelism, so
  pmap DP and jit DP give the single-device params AND batch_stats; in
  ensembles they are per member, so member i is the single-device run from
  its RNG;
- dropout: jit DP draws the single-device masks exactly; pmap DP folds the
  replica index into the step RNG (independent draws), so it differs, and
  only by that; ensemble members draw from their own streams;
- NNX modules give the same equivalences, partition specs and cross-strategy
  checkpoints as Linen ones.
"""

import functools

import jax
import numerics
import numpy as np
import pytest
import user_models as um
from conftest import SHARDED_8, cnn_config, image_batches, leaves, mlp_config, vector_batches
from jax.sharding import PartitionSpec

from strategies import BATCH_AXIS, member_rng
from trainer.checkpoint import Checkpointer, RunState, save_run

STEPS = 3

DATA_PARALLEL = {
    "pmap_data_parallel": {"strategy.name": "pmap_data_parallel"},
    "sharded_data_8": SHARDED_8,
}
ENSEMBLES = {
    "pmap_8": {"strategy.name": "pmap_ensemble", "ensemble_size": 8},
    "jit_4x2_data": {"strategy.name": "sharded_ensemble", "ensemble_size": 4,
                     "strategy.ensemble_mesh_shape": (4, 2)},
    "jit_4_on_1_vmap": {"strategy.name": "sharded_ensemble", "ensemble_size": 4,
                        "strategy.ensemble_mesh_shape": (1, 1),
                        "strategy.ensemble_loop": "vmap"},
}
TRAINERS = {
    "linen_resnet_bn": (um.ResNetTrainer, {}),
    "nnx_cnn": (um.NnxCNNTrainer, {}),
    "nnx_bn": (um.NnxBatchNormTrainer, {}),
}


def _fit(trainer_cls, overrides, batches, state=None, rng=None):
  trainer = trainer_cls(cnn_config(**overrides))
  if rng is not None:
    state = trainer.init_state(batches[0], rng=rng)
  state = trainer.fit(batches, num_steps=STEPS, state=state).state
  return trainer, state


def _canonical(trainer, state):
  return trainer.strategy.to_canonical({"params": state.params,
                                        "model_state": state.model_state})


def _assert_close(got, want):
  got_leaves, want_leaves = leaves(got), leaves(want)
  assert len(got_leaves) == len(want_leaves)
  for have, expect in zip(got_leaves, want_leaves, strict=True):
    assert have.shape == expect.shape
    np.testing.assert_allclose(have, expect, rtol=1e-4, atol=1e-5)


@functools.cache
def _single(name, rng_of=None):
  """The single-device run (from member `rng_of`'s init, if given), and its chaos runs
  (`tests/numerics.py`)."""
  trainer_cls, extra = TRAINERS[name]
  rng = None if rng_of is None else member_rng(jax.random.PRNGKey(cnn_config().seed), rng_of)
  batches = image_batches(STEPS, 16)
  trainer, state = _fit(trainer_cls, {"strategy.name": "single_device", **extra}, batches,
                        rng=rng)
  chaos = numerics.chaos_fits(trainer, batches, num_steps=STEPS, rng=rng,
                              view=lambda state: _canonical(trainer, state))
  return _canonical(trainer, state), chaos


@pytest.mark.parametrize("strategy", sorted(DATA_PARALLEL))
@pytest.mark.parametrize("model", sorted(TRAINERS))
def test_data_parallel_matches_single_device(model, strategy):
  trainer_cls, extra = TRAINERS[model]
  trainer, state = _fit(trainer_cls, {**DATA_PARALLEL[strategy], **extra},
                        image_batches(STEPS, 16))
  want, chaos = _single(model)
  numerics.assert_equivalent(_canonical(trainer, state), want, chaos)
  if model != "nnx_cnn":  # The statistics moved from their initial values: BatchNorm ran.
    means = [x for x in leaves(want["model_state"]) if not np.allclose(x, x.flat[0])]
    assert means, "batch statistics did not change"


@pytest.mark.parametrize("model,ensemble", [
    ("linen_resnet_bn", "pmap_8"), ("linen_resnet_bn", "jit_4x2_data"),
    ("nnx_bn", "pmap_8"), ("nnx_bn", "jit_4_on_1_vmap")])
def test_ensemble_members_match_single_device_runs(model, ensemble):
  """Per-member statistics: each member equals a single-device run from its RNG."""
  trainer_cls, extra = TRAINERS[model]
  trainer, state = _fit(trainer_cls, {**ENSEMBLES[ensemble], **extra}, image_batches(STEPS, 16))
  stacked = _canonical(trainer, state)
  for i in (0, trainer.strategy.num_members - 1):
    numerics.assert_equivalent(jax.tree.map(lambda x, i=i: x[i], stacked),
                               *_single(model, rng_of=i))


def test_eval_uses_running_statistics_and_they_survive_a_checkpoint_across_strategies(tmp_path):
  batches = image_batches(STEPS + 1, 16)
  writer, state = _fit(um.ResNetTrainer, DATA_PARALLEL["pmap_data_parallel"], batches[:STEPS])
  # Eval mode: each example's prediction ignores the rest of the batch.
  whole = writer.predict(state, batches[-1])
  np.testing.assert_allclose(writer.predict(state, {k: v[:3] for k, v in batches[-1].items()}),
                             whole[:3], rtol=1e-5, atol=1e-6)
  results = writer.evaluate(state, batches[-1:])
  ckpt = Checkpointer(tmp_path / "ckpt")
  save_run(ckpt, writer.strategy, RunState(state, STEPS))
  ckpt.wait()
  for strategy in ({"strategy.name": "single_device"}, SHARDED_8):
    reader = um.ResNetTrainer(cnn_config(**strategy))
    restored = reader.restore_checkpoint(ckpt, batches[0])
    _assert_close(_canonical(reader, restored), _canonical(writer, state))
    got = reader.evaluate(restored, batches[-1:])
    assert got.keys() == results.keys()
    for k in results:
      np.testing.assert_allclose(got[k], results[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("strategy", ["pmap_data_parallel", "jit_4x2_data"])
def test_batch_norm_over_a_local_shard_is_refused(strategy):
  overrides = {**DATA_PARALLEL, **ENSEMBLES}[strategy]

  class LocalTrainer(um.ResNetTrainer):
    def build_model(self):
      return um.LocalBatchNorm()

  trainer = LocalTrainer(cnn_config(**overrides))
  with pytest.raises(ValueError, match=r"BatchNorm .*\(axis_name=None\).*per replica.*"
                                       r"axis_name=strategies.BATCH_AXIS \('batch'\)"):
    trainer.fit(image_batches(1, 16), num_steps=1)
  # Where the step sees the whole batch, a local BatchNorm is the global one: it trains.
  single = LocalTrainer(cnn_config(**{"strategy.name": "single_device"}))
  single.fit(image_batches(1, 16), num_steps=1)


def test_an_unbound_axis_name_names_the_batch_axis():
  class WrongAxis(um.ResNetTrainer):
    def build_model(self):
      return um.LocalBatchNorm(axis_name="data")

  trainer = WrongAxis(cnn_config(**{"strategy.name": "single_device"}))
  with pytest.raises(ValueError, match=f"named strategies.BATCH_AXIS='{BATCH_AXIS}'"):
    trainer.fit(image_batches(1, 16), num_steps=1)


# -- Dropout, two inputs, a `deterministic` config field --------------------------------------


def _seq2seq(overrides, batches, **config):
  trainer = um.EncoderDecoderTrainer(cnn_config(**overrides, **config))
  result = trainer.fit(batches[:STEPS], num_steps=STEPS, eval_batches=lambda: batches[STEPS:])
  return trainer, result


@functools.cache
def _seq2seq_single(dropout_rate=0.2):
  trainer, result = _seq2seq({"strategy.name": "single_device"}, um.copy_batches(STEPS + 1, 16),
                             dropout_rate=dropout_rate)
  return trainer.strategy.to_canonical(result.state.params), result.final_eval


def test_dropout_under_jit_data_parallel_is_the_single_device_dropout():
  trainer, result = _seq2seq(SHARDED_8, um.copy_batches(STEPS + 1, 16), dropout_rate=0.2)
  params, results = _seq2seq_single()
  _assert_close(trainer.strategy.to_canonical(result.state.params), params)
  np.testing.assert_allclose(result.final_eval["loss"], results["loss"], rtol=1e-5)
  # Dropout really acted: without it training goes elsewhere.
  no_dropout, _ = _seq2seq_single(0.0)
  assert not all(np.allclose(a, b) for a, b in zip(leaves(params), leaves(no_dropout),
                                                   strict=True))


def test_dropout_under_pmap_data_parallel_differs_only_by_the_replica_streams():
  batches = um.copy_batches(STEPS + 1, 16)
  pmap = {"strategy.name": "pmap_data_parallel"}
  trainer, result = _seq2seq(pmap, batches, dropout_rate=0.2)
  with_dropout = trainer.strategy.to_canonical(result.state.params)
  assert not all(np.allclose(a, b, rtol=1e-4) for a, b in zip(
      leaves(with_dropout), leaves(_seq2seq_single()[0]), strict=True))
  trainer, result = _seq2seq(pmap, batches, dropout_rate=0.0)
  _assert_close(trainer.strategy.to_canonical(result.state.params), _seq2seq_single(0.0)[0])


def test_eval_mode_is_deterministic_for_a_module_with_a_deterministic_field():
  batches = um.copy_batches(STEPS + 2, 16)
  trainer, result = _seq2seq({"strategy.name": "single_device"}, batches, dropout_rate=0.5)
  state = result.state
  first, again = (trainer.evaluate(state, batches[-1:]) for _ in range(2))
  assert first == again
  # Evaluation is the deterministic model: a zero dropout rate gives the same result.
  no_dropout = um.EncoderDecoderTrainer(cnn_config(dropout_rate=0.0))
  assert no_dropout.evaluate(state, batches[-1:])["loss"] == pytest.approx(first["loss"],
                                                                           rel=1e-6)


@pytest.mark.parametrize("ensemble", ["pmap_8", "jit_4x2_data"])
def test_ensemble_members_draw_their_own_dropout_streams(ensemble):
  """Member i's dropout is that of a single-device run from member_rng(i), so members differ."""
  batches = um.copy_batches(STEPS + 1, 16)
  overrides = dict(ENSEMBLES[ensemble])
  trainer, result = _seq2seq(overrides, batches, dropout_rate=0.2)
  stacked = trainer.strategy.to_canonical(result.state.params)
  base = jax.random.PRNGKey(trainer.config.seed)
  single = um.EncoderDecoderTrainer(cnn_config(**{"strategy.name": "single_device"},
                                               dropout_rate=0.2))
  member = single.fit(batches[:STEPS], num_steps=STEPS,
                      state=single.init_state(batches[0], rng=member_rng(base, 1))).state
  got = jax.tree.map(lambda x: x[1], stacked)
  if trainer.strategy.step_sees_batch_shard:
    # Two data replicas per member fold their index into the stream, as pmap DP does.
    assert not all(np.allclose(a, b, rtol=1e-4) for a, b in zip(
        leaves(got), leaves(single.strategy.to_canonical(member.params)), strict=True))
  else:
    _assert_close(got, single.strategy.to_canonical(member.params))


# -- Named RNG streams and an RNG argument -----------------------------------------------------


def test_streams_a_model_asks_for_come_from_rng_streams():
  batches = image_batches(STEPS, 16)
  trainer, state = _fit(um.NoisyTrainer, {"strategy.name": "single_device"}, batches)
  again, state_again = _fit(um.NoisyTrainer, {"strategy.name": "single_device"}, batches)
  _assert_close(state_again.params, state.params)  # A function of (seed, step) alone.
  streams = trainer.step_rngs(jax.random.PRNGKey(0))
  assert sorted(streams) == ["dropout", "noise", "z"]
  assert len({tuple(np.asarray(jax.random.key_data(k)).ravel()) if jax.dtypes.issubdtype(
      k.dtype, jax.dtypes.prng_key) else tuple(np.asarray(k).ravel())
      for k in streams.values()}) == 3

  class Missing(um.NoisyTrainer):
    rng_streams = ("dropout", "z")

  with pytest.raises(ValueError, match=r"needs PRNG for \"noise\".*rng_streams="
                                       r"\('dropout', 'z'\): add the stream"):
    Missing(cnn_config(**{"strategy.name": "single_device"})).fit(batches, num_steps=1)


# -- NNX: partition specs and cross-strategy checkpoints ---------------------------------------


def test_nnx_mlp_is_laid_out_by_the_rule_table_and_matches_single_device():
  batches = vector_batches(STEPS, 16, 8)
  sharded = um.NnxMLPTrainer(mlp_config())
  state = sharded.fit(batches, num_steps=STEPS).state
  w1, w2 = state.params["W1"], state.params["W2"]
  assert w1.names == ("layer", "embed", "hidden")
  assert w1.value.sharding.spec == PartitionSpec(None, None, "model")
  assert w2.value.sharding.spec == PartitionSpec(None, "model", None)
  shard = w1.value.addressable_shards[0].data
  assert shard.shape == (2, 8, 16 // 4)  # hidden split 4 ways over 'model'.
  adam = state.opt_state[0]
  assert adam.mu["W1"].value.sharding.spec == PartitionSpec(None, None, "model")
  single = um.NnxMLPTrainer(mlp_config(**{"strategy.name": "single_device"}))
  _assert_close(sharded.strategy.to_canonical(state.params),
                single.strategy.to_canonical(single.fit(batches, num_steps=STEPS).state.params))


@pytest.mark.parametrize("source,destination", [
    ("sharded_data_parallel", "pmap_data_parallel"),
    ("pmap_data_parallel", "single_device"),
])
def test_nnx_checkpoint_restores_under_another_strategy(tmp_path, source, destination):
  batches = vector_batches(STEPS, 16, 8)
  writer = um.NnxMLPTrainer(mlp_config(**{"strategy.name": source}))
  ckpt = Checkpointer(tmp_path / "ckpt", every_steps=STEPS)
  saved = writer.fit(batches, num_steps=STEPS, checkpointer=ckpt).state
  reader = um.NnxMLPTrainer(mlp_config(**{"strategy.name": destination}))
  restored = reader.restore_checkpoint(ckpt, batches[0])
  _assert_close(jax.device_get(reader.strategy.checkpoint_state(restored)),
                jax.device_get(writer.strategy.checkpoint_state(saved)))
  np.testing.assert_allclose(reader.predict(restored, batches[0]),
                             writer.predict(saved, batches[0]), rtol=1e-5, atol=1e-6)


def test_an_nnx_instance_is_refused_with_the_factory_to_return():
  from flax import nnx

  import models

  class Instance(um.NnxCNNTrainer):
    def build_model(self):
      return models.nnx_models.CNN(rngs=nnx.Rngs(0))

  with pytest.raises(TypeError, match=r"return its factory instead, e.g. "
                                      r"`functools.partial\(CNN, \.\.\.\)`"):
    Instance(cnn_config())
