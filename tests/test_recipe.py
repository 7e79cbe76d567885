"""The training recipe: schedules, clipping, weight-decay masks, gradient accumulation,
mixed precision, EMA, early stopping, best checkpoints and profiling.

Each feature is switched on from the config, as a user would, and checked
against what it must equal: accumulation against the big-batch step under
every strategy, bf16 against fp32, the EMA against its recurrence.
"""

import functools
import glob
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import user_models as um
from conftest import (
  SHARDED_8,
  CNNTrainer,
  MLPTrainer,
  cnn_config,
  image_batches,
  leaves,
  mlp_config,
  vector_batches,
)
from flax import nnx

import configs.base as base
import models
from trainer.checkpoint import Checkpointer
from trainer.language_model import synthetic_token_batches
from trainer.step import optim
from trainer.step.precision import embeddings_follow_their_tables
from trainer.step.recipe import MixedPrecision


def recorder():
  """A clu writer (any clu `MetricWriter` is a run's writer) that keeps every scalar
  written, by step in `rows`. clu's writers import TensorFlow, so only the test that uses
  one pays for it, not every worker's collection."""
  from clu import metric_writers

  class Recorder(metric_writers.LoggingWriter):
    def __init__(self):
      super().__init__()
      self.rows: dict[int, dict[str, float]] = {}

    def write_scalars(self, step, scalars):
      self.rows.setdefault(step, {}).update({k: float(v) for k, v in scalars.items()})

  return Recorder()


def _assert_trees_close(a, b, rtol=1e-5, atol=1e-6):
  for x, y in zip(leaves(a), leaves(b), strict=True):
    np.testing.assert_allclose(x, y, rtol=rtol, atol=atol)


# -- Schedules, clipping, weight decay ----------------------------------------------------------


def test_warmup_cosine_schedule_is_logged_and_drives_the_updates():
  config = mlp_config(optimizer="sgd", momentum=0.0, learning_rate=0.1, num_train_steps=6,
                      log_every_steps=1, **{"schedule.name": "cosine",
                                            "schedule.warmup_steps": 2,
                                            "schedule.end_factor": 0.1})
  trainer, writer = MLPTrainer(config), recorder()
  batches = vector_batches(6, 16, 8)
  init = trainer.init_state(batches[0])
  initial = leaves(init.params)  # Host copies: fit donates the state it is given.
  result = trainer.fit(batches, num_steps=6, writer=writer,
                       state=jax.tree.map(jnp.copy, init))
  logged = [writer.rows[s]["train/learning_rate"] for s in range(1, 7)]
  # Warmup from 0: 0, 0.05; then cosine from 0.1 down towards 0.01 at step 6.
  expected = [0.0, 0.05] + [0.01 + 0.09 * 0.5 * (1 + np.cos(np.pi * i / 4)) for i in range(4)]
  np.testing.assert_allclose(logged, expected, rtol=1e-5, atol=1e-7)
  # The first update used rate 0: one step leaves the parameters where they were.
  one = MLPTrainer(config).fit(batches[:1], num_steps=1, state=init).state
  _assert_trees_close(one.params, initial, rtol=0, atol=0)
  assert not np.allclose(leaves(result.state.params)[0], initial[0])


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_weight_decay_skips_biases_and_norm_scales(name):
  params = {"Dense_0": {"kernel": jnp.ones((2, 3)), "bias": jnp.ones(3)},
            "BatchNorm_0": {"scale": jnp.ones(3), "bias": jnp.ones(3)}}
  config = cnn_config(optimizer=name, momentum=0.0, learning_rate=1.0, weight_decay=0.1)
  tx = optim.create_optimizer(config, optim.create_schedule(config, None))
  updates, _ = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
  np.testing.assert_allclose(updates["Dense_0"]["kernel"], -0.1 * np.ones((2, 3)), rtol=1e-6)
  for path in (("Dense_0", "bias"), ("BatchNorm_0", "scale"), ("BatchNorm_0", "bias")):
    np.testing.assert_array_equal(updates[path[0]][path[1]], 0.0)


def test_the_default_decay_mask_reads_real_models():
  resnet = models.ResNet(stage_sizes=(1,), num_filters=4, num_classes=10)
  variables = resnet.init(jax.random.PRNGKey(0), jnp.zeros((1, 28, 28, 1)), train=False)
  mask = optim.default_decay_mask(variables["params"])
  flat = {"/".join(str(k.key) for k in p): v for p, v in
          jax.tree_util.tree_leaves_with_path(mask)}
  assert flat and all(v == ("kernel" in path) for path, v in flat.items()), flat
  # Logical boxes (the sharded MLP) are looked through: its stacked kernels decay.
  trainer = MLPTrainer(mlp_config())
  state = trainer.init_state(vector_batches(1, 16, 8)[0])
  assert all(jax.tree.leaves(optim.default_decay_mask(state.params)))


def test_clipping_bounds_the_global_norm_of_the_update():
  config = cnn_config(optimizer="sgd", momentum=0.0, learning_rate=1.0, grad_clip_norm=1.0)
  tx = optim.create_optimizer(config, optim.create_schedule(config, None))
  params = {"w": jnp.zeros(4)}
  updates, _ = tx.update({"w": jnp.full(4, 5.0)}, tx.init(params), params)
  assert float(optax.tree.norm(updates)) == pytest.approx(1.0, rel=1e-6)
  small, _ = tx.update({"w": jnp.full(4, 0.1)}, tx.init(params), params)
  np.testing.assert_allclose(small["w"], -0.1, rtol=1e-6)  # Below the bound: unchanged.


# -- Gradient accumulation --------------------------------------------------------------------

STEPS = 3
ACCUM_STRATEGIES = {  # The loop is the platform's default (unrolled on CPU) unless named.
    "single_device": {"strategy.name": "single_device"},
    "single_device_scan": {"strategy.name": "single_device", "grad_accum_loop": "scan"},
    "pmap_data_parallel_scan": {"strategy.name": "pmap_data_parallel", "grad_accum_loop": "scan"},
    "pmap_data_parallel": {"strategy.name": "pmap_data_parallel"},
    "sharded_2x4_rules": {},  # mlp_config's own mesh: data 2 x model 4, tensor parallel.
    "sharded_data_8": SHARDED_8,
    "pmap_ensemble": {"strategy.name": "pmap_ensemble", "ensemble_size": 8},
    "sharded_ensemble_4x2": {"strategy.name": "sharded_ensemble", "ensemble_size": 4,
                             "strategy.ensemble_mesh_shape": (4, 2)},
}


def _accum_run(overrides, k):
  trainer = MLPTrainer(mlp_config(batch_size=32, grad_accum_steps=k, **overrides))
  batches = vector_batches(STEPS, 32, 8)
  state = trainer.fit(batches, num_steps=STEPS).state
  return trainer, state


@functools.cache
def _big_batch_reference(strategy):
  """The canonical (params, opt_state) without accumulation: one single-device run serves
  every non-ensemble strategy; an ensemble is compared with itself."""
  trainer, big = _accum_run(ACCUM_STRATEGIES[strategy], 1)
  return trainer.strategy.to_canonical((big.params, big.opt_state))


@pytest.mark.parametrize("strategy", list(ACCUM_STRATEGIES))
def test_accumulation_equals_the_big_batch_step(strategy):
  overrides = ACCUM_STRATEGIES[strategy]
  reference = _big_batch_reference(strategy if "ensemble" in strategy else "single_device")
  trainer, accum = _accum_run(overrides, 2)
  assert int(np.ravel(trainer.strategy.to_canonical(accum.step))[0]) == STEPS  # Updates.
  _assert_trees_close(trainer.strategy.to_canonical((accum.params, accum.opt_state)),
                      reference, rtol=2e-5, atol=2e-6)


def _collectives(text):
  return sorted(set(re.findall(r"\b(all-reduce|all-gather|all-to-all|collective-permute|"
                               r"reduce-scatter)(?:-start)?\(", text)))


@pytest.mark.parametrize("loop", ["scan", "unroll"])
def test_accumulation_keeps_the_batch_sharded_on_the_microbatch_axis(loop):
  """Under jit on an 8-way data mesh, microbatches are never gathered or resharded."""
  batch = vector_batches(1, 32, 8)[0]
  texts = {}
  for k in (1, 4):
    trainer = MLPTrainer(mlp_config(batch_size=32, grad_accum_steps=k, grad_accum_loop=loop,
                                    **SHARDED_8))
    texts[k] = trainer.compiled.train_text(trainer.init_state(batch), batch)
  assert _collectives(texts[4]) == _collectives(texts[1]) == ["all-reduce"]


def test_the_whole_recipe_resumes_bit_for_bit(tmp_path):
  """A user's NNX model with BatchNorm and dropout under pmap DP, with accumulation (dropout
  per microbatch), EMA, warmup-cosine, clipping and AdamW: stopped at step 3 and resumed by a
  new Trainer, it ends where the uninterrupted run ends, to the bit."""
  config = cnn_config(**{
      "strategy.name": "pmap_data_parallel", "dropout_rate": 0.3, "grad_accum_steps": 2,
      "ema_decay": 0.9, "optimizer": "adamw", "learning_rate": 1e-2, "weight_decay": 0.1,
      "grad_clip_norm": 1.0, "schedule.name": "cosine", "schedule.warmup_steps": 2,
      "num_train_steps": 6})
  batches = image_batches(6, 16)

  def run(num_steps, ckpt=None):
    trainer = um.NnxBatchNormTrainer(config)
    state = trainer.fit(lambda start: batches[start:], num_steps=num_steps,
                        checkpointer=ckpt).state
    return trainer.strategy.to_canonical(state)

  straight = run(6)
  ckpt = Checkpointer(tmp_path / "ckpt", every_steps=3)
  run(3, ckpt)
  resumed = run(6, ckpt)
  ckpt.close()
  paths = [[jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(t)]
           for t in (resumed, straight)]
  assert paths[0] == paths[1] and any("ema_params" in p for p in paths[0])
  assert int(resumed.step) == 6 and jax.tree.leaves(resumed.model_state)
  _assert_trees_close(resumed, straight, rtol=0, atol=0)
  assert not np.allclose(leaves(resumed.ema_params)[0], leaves(resumed.params)[0])


# -- Mixed precision ----------------------------------------------------------------------------


def _matmuls(trainer, state, batch) -> list[str]:
  """The lowered train step's convolutions and matmuls (forward and backward)."""
  lowered = trainer.compiled.train(state).lower(state, trainer.strategy.put_batch(batch))
  return re.findall(r"stablehlo\.(?:convolution|dot_general).*", lowered.as_text())


def test_bfloat16_computes_in_bfloat16_and_trains_like_float32():
  batches = image_batches(6, 16)
  bf16 = CNNTrainer(cnn_config(**{"mixed_precision.compute_dtype": "bfloat16"}))
  state = bf16.init_state(batches[0])
  initial = np.concatenate([x.ravel() for x in leaves(state.params)])
  ops = _matmuls(bf16, state, batches[0])
  assert len(ops) >= 6  # Forward and backward convolutions and matmuls.
  assert all("bf16" in op and "xf32>" not in op.split("->")[-1] for op in ops), ops
  result = bf16.fit(batches[:5], num_steps=5, state=state, eval_batches=lambda: batches[5:])
  assert {x.dtype for x in jax.tree.leaves((result.state.params, result.state.opt_state))
          if jnp.issubdtype(x.dtype, jnp.floating)} == {jnp.dtype(jnp.float32)}
  f32 = CNNTrainer(cnn_config()).fit(batches[:5], num_steps=5, eval_batches=lambda: batches[5:])
  # The stated tolerance: after 5 steps the bf16 run's parameter change is within 10% (in
  # norm) of the fp32 run's, and the eval NLL within 2%.
  moved = {name: np.concatenate([x.ravel() for x in leaves(r.state.params)]) - initial
           for name, r in (("bf16", result), ("f32", f32))}
  error = np.linalg.norm(moved["bf16"] - moved["f32"]) / np.linalg.norm(moved["f32"])
  assert 0 < error < 0.1, error
  assert result.final_eval["nll"] == pytest.approx(f32.final_eval["nll"], rel=0.02)


def test_a_users_nnx_decoder_with_default_embeddings_computes_in_bfloat16():
  # Token and position `nnx.Embed`s built without a dtype, as Flax's NNX examples write them:
  # NNX fixes their dtype at float32 when built, which would cast the bf16 tables back.
  config = base.get_config()
  config.batch_size = config.eval_batch_size = 8
  config.mixed_precision.compute_dtype = "bfloat16"
  batch = next(iter(synthetic_token_batches(0, 8, 8, 32)))
  trainer = um.MiniGptTrainer(config)
  ops = _matmuls(trainer, trainer.init_state(batch), batch)
  assert len(ops) >= 12  # Attention, MLP and head, forward and backward.
  # Every product takes bf16 operands, or multiplies them as bf16 (Flax's attention keeps
  # its softmax in f32 and names the product's precision: `lhs_precision_type = bf16`).
  as_bf16 = "algorithm = <lhs_precision_type = bf16, rhs_precision_type = bf16"
  operands = [(op.split(" : (")[1].split(") ->")[0], as_bf16 in op) for op in ops]
  assert all(named or ("bf16" in o and "xf32>" not in o) for o, named in operands), ops


def test_an_nnx_embed_follows_its_table_unless_built_with_another_dtype():
  class Two(nnx.Module):
    def __init__(self, rngs):
      self.default = nnx.Embed(8, 4, rngs=rngs)
      self.half = nnx.Embed(8, 4, dtype=jnp.float16, rngs=rngs)

  model = Two(nnx.Rngs(0))
  graph, params = nnx.split(model)
  model = nnx.merge(graph, jax.tree.map(lambda x: x.astype(jnp.bfloat16), params))
  assert model.default(jnp.arange(3)).dtype == jnp.float32  # NNX's own: fixed when built.
  embeddings_follow_their_tables(model)
  assert model.default(jnp.arange(3)).dtype == jnp.bfloat16
  assert model.half(jnp.arange(3)).dtype == jnp.float16


def test_float16_scales_the_loss_and_unscales_the_gradients():
  """One SGD step in float16 with the default static loss scale (2**12) moves the parameters
  as float32 does (within float16 precision), not 4096 times as far."""
  batch = vector_batches(1, 16, 8)
  moved = {}
  for dtype in ("float32", "float16"):
    trainer = MLPTrainer(mlp_config(optimizer="sgd", momentum=0.0, learning_rate=0.1, **{
        "mixed_precision.compute_dtype": dtype}))
    state = trainer.init_state(batch[0])
    before = np.concatenate([x.ravel() for x in leaves(state.params)])
    after = trainer.fit(batch, num_steps=1, state=state).state
    moved[dtype] = np.concatenate([x.ravel() for x in leaves(after.params)]) - before
  [precision] = [t.precision for t in trainer.recipe.transforms if isinstance(t, MixedPrecision)]
  assert precision.loss_scale == 2.0 ** 12
  error = np.linalg.norm(moved["float16"] - moved["float32"]) / np.linalg.norm(moved["float32"])
  assert np.linalg.norm(moved["float32"]) > 0 and error < 0.01, error


# -- EMA ------------------------------------------------------------------------------------------


def test_ema_follows_its_recurrence_is_evaluated_and_restores_under_another_strategy(tmp_path):
  batches = vector_batches(4, 16, 8)
  config = dict(ema_decay=0.75, **{"strategy.name": "pmap_data_parallel"})
  trainer = MLPTrainer(mlp_config(**config))
  state = trainer.init_state(batches[0])
  ema = trainer.strategy.to_canonical(state.params)
  for step in range(3):
    state = trainer.fit(batches[step:step + 1], num_steps=step + 1, state=state).state
    ema = jax.tree.map(lambda e, p: 0.75 * e + 0.25 * p, ema,
                       trainer.strategy.to_canonical(state.params))
  _assert_trees_close(trainer.strategy.to_canonical(state.ema_params), ema)
  results = trainer.evaluate(state.replace(params=state.ema_params), batches[3:])
  ckpt = Checkpointer(tmp_path / "ckpt", every_steps=0)
  result = trainer.fit(batches[3:], num_steps=4, state=state, checkpointer=ckpt,
                       eval_batches=lambda: batches[3:])
  assert result.final_eval["ema_loss"] != result.final_eval["loss"]
  assert results["loss"] != result.final_eval["ema_loss"]  # One more update moved the average.
  ckpt.wait()
  for strategy in (SHARDED_8, {"strategy.name": "single_device"}):
    other = MLPTrainer(mlp_config(ema_decay=0.75, **strategy))
    restored = other.restore_checkpoint(ckpt, batches[0])
    _assert_trees_close(other.strategy.to_canonical(restored.ema_params),
                        trainer.strategy.to_canonical(result.state.ema_params), rtol=0, atol=0)
  ckpt.close()


# -- Early stopping and the best checkpoint --------------------------------------------------


def test_early_stopping_saves_keeps_the_best_and_stays_stopped(tmp_path):
  batches = vector_batches(12, 16, 8)
  # min_delta so large that no evaluation after the first counts as better.
  config = mlp_config(eval_every_steps=1, **{
      "early_stopping.metric": "loss", "early_stopping.patience": 2,
      "early_stopping.min_delta": 1e9, "checkpoint.best_metric": "loss",
      "checkpoint.best_mode": "min", "checkpoint.max_to_keep": 1})
  ckpt = Checkpointer.from_config(config, str(tmp_path))
  result = MLPTrainer(config).fit(lambda start: batches[start:], num_steps=10,
                                  checkpointer=ckpt, eval_batches=lambda: batches[-1:])
  assert (result.stopped_by, result.step) == ("early_stopping", 3)
  assert result.best == (1, result.eval_history[0][1]["loss"])
  losses = {step: r["loss"] for step, r in result.eval_history}
  ckpt.wait()
  # The latest checkpoint (to resume) and the best by eval loss (orbax's BestN) are kept.
  assert ckpt.best_step() == min(losses, key=losses.get)
  assert set(ckpt.all_steps()) == {3, ckpt.best_step()}
  # The same command again: the early-stopping state came back with the checkpoint.
  again = MLPTrainer(config).fit(lambda start: batches[start:], num_steps=10,
                                 checkpointer=ckpt, eval_batches=lambda: batches[-1:])
  assert (again.stopped_by, again.step, again.eval_history) == ("early_stopping", 3, [])
  ckpt.close()


# -- Profiling ---------------------------------------------------------------------------------


def test_profile_traces_the_configured_steps_into_the_workdir(tmp_path):
  config = mlp_config(**{"profile.first_step": 1, "profile.num_steps": 2})
  MLPTrainer(config).fit(vector_batches(4, 16, 8), num_steps=4, workdir=str(tmp_path))
  traces = glob.glob(os.path.join(tmp_path, "plugins", "profile", "*", "*.xplane.pb"))
  assert len(traces) == 1 and os.path.getsize(traces[0]) > 0
