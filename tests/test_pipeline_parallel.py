"""Pipeline parallelism (`strategies/pipeline.py`, `models/layer_stack.py`): the transformer LM
and an NNX decoder written like Flax's NNX examples train under pipeline layouts as on one
device; dropout equals the same microbatches run one after another on one device; the
stacked parameters are one checkpoint layout; a killed run resumes exactly; and what
cannot be pipelined is refused before compiling."""

import itertools
import pathlib
import signal
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numerics
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from small_configs import tiny_lm_config
from user_models import StackedDecoder, StackedDecoderTrainer

import models
from configs import base
from configs.lm import rules
from strategies import ShardedDataParallel
from strategies.pipeline import Pipeline, PipelineError
from trainer import Trainer
from trainer.checkpoint import Checkpointer
from trainer.language_model import LanguageModelTrainer, synthetic_token_batches
from trainer.plan import make_plan

STEPS = 3
PIPE = {"strategy.mesh_shape": (2, 4), "strategy.mesh_axes": ("data", "stage"),
        "strategy.logical_axis_rules": rules(layer="stage")}


def lm_config(layout="pipeline", **overrides):
  return tiny_lm_config(layout, **{"model.num_layers": 4, **overrides})


def token_batches(config, num=STEPS + 1):
  return list(itertools.islice(synthetic_token_batches(
      config.seed, config.batch_size, config.seq_len, config.model.vocab_size), num))


def canonical(trainer, state):
  return jax.device_get(trainer.strategy.to_canonical(nn.meta.unbox(state.params)))


def fit(trainer, batches, **kwargs):
  return trainer.fit(batches[:STEPS], num_steps=STEPS, **kwargs).state


@pytest.fixture(scope="module")
def lm_reference():
  config = lm_config(**{"strategy.name": "single_device"})
  trainer = LanguageModelTrainer(config)
  batches = token_batches(config)
  state = fit(trainer, batches)
  chaos = numerics.chaos_fits(trainer, batches[:STEPS], num_steps=STEPS,
                              view=lambda state: canonical(trainer, state))
  return canonical(trainer, state), trainer.evaluate(state, batches[STEPS:]), chaos


LM_CASES = {
    "gpipe, 4 stages x 2 data, 4 microbatches": ("pipeline", {"strategy.pipeline.microbatches": 4}),
    "gpipe, 4 stages x 2 data, 8 microbatches": ("pipeline", {}),
    "circular, 2 stages x 2 repeats x 4 data": ("pipeline_circular", {
        "strategy.mesh_shape": (4, 2), "strategy.pipeline.microbatches": 4}),
    "2 data x 2 stages x 2 model (tensor parallel)": ("pipeline_tensor", {}),
    "fsdp within stages, stages rematerialised": ("pipeline_fsdp", {
        "strategy.pipeline.remat": True}),
    "with 2 accumulation steps, 2 steps per call and an EMA": ("pipeline", {
        "grad_accum_steps": 2, "steps_per_call": 2, "strategy.pipeline.microbatches": 4,
        "ema_decay": 0.5}),
}


@pytest.mark.parametrize("case", list(LM_CASES))
def test_the_lm_pipelined_trains_like_a_single_device(case, lm_reference):
  layout, overrides = LM_CASES[case]
  config = lm_config(layout, **overrides)
  trainer = LanguageModelTrainer(config)
  assert trainer.strategy.pipeline is not None
  batches = token_batches(config)
  state = fit(trainer, batches)
  want_params, want_eval, chaos = lm_reference
  numerics.assert_equivalent(canonical(trainer, state), want_params, chaos)
  np.testing.assert_allclose(trainer.evaluate(state, batches[STEPS:])["loss"], want_eval["loss"],
                             rtol=1e-5)


def test_eval_batches_of_any_size_are_padded_to_whole_microbatches():
  config = lm_config(eval_batch_size=6)  # 8 microbatches x 2 data shards: padded to 16.
  piped = LanguageModelTrainer(config)
  assert piped.strategy.batch_multiple == 16
  batches = token_batches(config, 2)
  single = LanguageModelTrainer(lm_config(**{"strategy.name": "single_device",
                                             "eval_batch_size": 6}))
  want = single.evaluate(single.init_state(batches[0]), batches)["loss"]
  got = piped.evaluate(piped.init_state(batches[0]), batches)["loss"]
  np.testing.assert_allclose(got, want, rtol=1e-5)


def test_each_stage_holds_its_own_layers_and_the_activations_move_by_permutes():
  config = lm_config("pipeline_circular", **{"model.num_layers": 8})
  trainer = LanguageModelTrainer(config)
  batch = token_batches(config, 1)[0]
  state = trainer.init_state(batch)
  kernel = state.params["blocks"]["wi"]["kernel"].value
  assert kernel.sharding.spec == P("stage", None, None)
  assert kernel.sharding.shard_shape(kernel.shape)[0] == 2  # 8 layers over 4 stages.
  plan = make_plan(trainer, batch)
  assert plan.collectives.get("collective-permute", 0) >= 1
  report = plan.report()
  assert "circular schedule, 8 microbatches, 2 repeat(s), bubble 15.8%" in report
  assert "stage 0: layers 0, 4" in report and "stage 3: layers 3, 7" in report


def test_with_remat_a_stage_holds_a_boundary_per_microbatch_not_its_activations():
  # Microbatches of a fixed size (4 rows): 4 of them, then 16. GPipe keeps every layer's
  # activations of every microbatch; with remat a stage keeps its input per microbatch.
  temp = {}
  for remat in (False, True):
    for microbatches in (4, 16):
      config = lm_config(**{"strategy.pipeline.microbatches": microbatches,
                            "strategy.pipeline.remat": remat, "batch_size": 4 * microbatches})
      trainer = LanguageModelTrainer(config)
      temp[remat, microbatches] = make_plan(trainer, token_batches(config, 1)[0]).temp_bytes
  gpipe_growth = temp[False, 16] - temp[False, 4]
  remat_growth = temp[True, 16] - temp[True, 4]
  assert gpipe_growth > 0
  assert remat_growth < 0.5 * gpipe_growth, temp
  assert temp[True, 16] < temp[False, 4], temp


def test_pipeline_bubble_and_stage_layout():
  gpipe = Pipeline(stages=4, microbatches=8)
  assert gpipe.bubble_fraction == pytest.approx(3 / 11)  # (S - 1) / (M + S - 1).
  circular = Pipeline(stages=4, microbatches=8, repeats=2)
  assert circular.bubble_fraction == pytest.approx(3 / 19)
  assert circular.stage_layers(16)[1] == [range(2, 4), range(10, 12)]


# -- An NNX decoder written like Flax's NNX examples ------------------------------------------


def nnx_config(**overrides):
  config = base.get_config()
  config.batch_size = config.eval_batch_size = 16
  config.log_every_steps = 100
  config.optimizer, config.learning_rate = "sgd", 0.5
  config.update_from_flattened_dict(overrides)
  return config


NNX_PIPE = {"strategy.name": "sharded_data_parallel", **PIPE,
            "strategy.pipeline.microbatches": 4}


def nnx_batches():
  return [b for b, _ in zip(synthetic_token_batches(0, 16, 8, 32), range(STEPS), strict=False)]


class DropoutDecoderTrainer(StackedDecoderTrainer):
  dropout = 0.3


def one_device_pipeline(microbatches=4):
  """A pipeline of one stage on one device: the microbatches one after another."""
  return ShardedDataParallel((1, 1), ("data", "stage"), rules(layer="stage"),
                             devices=jax.devices()[:1], pipeline={"microbatches": microbatches})


def test_an_nnx_stacked_decoder_pipelined_trains_like_a_single_device():
  single = StackedDecoderTrainer(nnx_config(**{"strategy.name": "single_device"}))
  want = canonical(single, fit(single, nnx_batches()))
  chaos = numerics.chaos_fits(single, nnx_batches(), num_steps=STEPS,
                              view=lambda state: canonical(single, state))
  piped = StackedDecoderTrainer(nnx_config(**NNX_PIPE))
  state = fit(piped, nnx_batches())
  assert state.params["blocks"]["layers"]["up"]["kernel"].value.sharding.spec[0] == "stage"
  # An unannotated parameter in the stack (LayerNorm's) is put on the stages too.
  assert state.params["blocks"]["layers"]["norm1"]["scale"].value.sharding.spec[0] == "stage"
  numerics.assert_equivalent(canonical(piped, state), want, chaos)


def test_with_dropout_a_pipeline_equals_its_microbatches_one_after_another_on_one_device():
  one = DropoutDecoderTrainer(nnx_config(**NNX_PIPE), strategy=one_device_pipeline())
  want = canonical(one, fit(one, nnx_batches()))
  chaos = numerics.chaos_fits(one, nnx_batches(), num_steps=STEPS,
                              view=lambda state: canonical(one, state))
  piped = DropoutDecoderTrainer(nnx_config(**NNX_PIPE))
  numerics.assert_equivalent(canonical(piped, fit(piped, nnx_batches())), want, chaos)
  # The dropout is real: without microbatches the masks, and so the parameters, differ.
  plain = DropoutDecoderTrainer(nnx_config(**{"strategy.name": "single_device"}))
  other = canonical(plain, fit(plain, nnx_batches()))
  assert max(float(np.abs(a - b).max()) for a, b in zip(
      jax.tree.leaves(other), jax.tree.leaves(want), strict=True)) > 1e-3


# -- One checkpoint layout; exact resume --------------------------------------------------------


@pytest.fixture(scope="module")
def pipelined_checkpoint(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("pipelined")
  config = lm_config()
  trainer = LanguageModelTrainer(config)
  checkpointer = Checkpointer(workdir)
  try:
    state = fit(trainer, token_batches(config), checkpointer=checkpointer)
  finally:
    checkpointer.close()
  return workdir, canonical(trainer, state)


def restore(workdir, **overrides):
  config = lm_config(**overrides)
  trainer = LanguageModelTrainer(config)
  checkpointer = Checkpointer(workdir)
  try:
    return trainer, trainer.restore_checkpoint(checkpointer, token_batches(config, 1)[0])
  finally:
    checkpointer.close()


@pytest.mark.parametrize("strategy", [
    {"strategy.name": "single_device"}, {"strategy.name": "pmap_data_parallel"},
    {"strategy.mesh_shape": (-1,), "strategy.mesh_axes": ("data",),
     "strategy.logical_axis_rules": rules(embed="data"), "strategy.pipeline.microbatches": 0}])
def test_a_pipelined_checkpoint_restores_under_another_strategy(pipelined_checkpoint, strategy):
  workdir, want = pipelined_checkpoint
  trainer, state = restore(workdir, **strategy)
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(canonical(trainer, state)), strict=True):
    np.testing.assert_array_equal(a, b)


def test_a_single_device_checkpoint_restores_pipelined(tmp_path):
  config = lm_config(**{"strategy.name": "single_device"})
  trainer = LanguageModelTrainer(config)
  checkpointer = Checkpointer(tmp_path)
  try:
    want = canonical(trainer, fit(trainer, token_batches(config), checkpointer=checkpointer))
  finally:
    checkpointer.close()
  piped, state = restore(tmp_path)
  assert state.params["blocks"]["wi"]["kernel"].value.sharding.spec[0] == "stage"
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(canonical(piped, state)), strict=True):
    np.testing.assert_array_equal(a, b)


SCRIPT = pathlib.Path(__file__).parent / "pipeline_resume_run.py"


def _run(workdir, out, *extra):
  return subprocess.run([sys.executable, str(SCRIPT), f"--workdir={workdir}", f"--out={out}",
                         *extra], capture_output=True, text=True, timeout=300)


def test_a_pipelined_run_killed_after_a_save_resumes_to_the_same_state(tmp_path):
  straight = _run(tmp_path / "straight", tmp_path / "straight.npz")
  assert straight.returncode == 0, straight.stderr[-3000:]
  killed = _run(tmp_path / "work", tmp_path / "final.npz", "--kill_after_save_at=2")
  assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
  resumed = _run(tmp_path / "work", tmp_path / "final.npz")
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "Resuming at step 2" in resumed.stderr
  a, b = np.load(tmp_path / "straight.npz"), np.load(tmp_path / "final.npz")
  assert sorted(a) == sorted(b)
  for key in a:
    np.testing.assert_array_equal(a[key], b[key], err_msg=key)  # Bit for bit.


# -- Mixed precision ----------------------------------------------------------------------------


def test_under_bfloat16_the_stages_pass_bfloat16_activations():
  config = lm_config(**{"mixed_precision.compute_dtype": "bfloat16"})
  trainer = LanguageModelTrainer(config)
  batch = token_batches(config, 1)[0]
  state = trainer.init_state(batch)
  jaxpr = trainer.compiled.train(state).trace(state, trainer.strategy.put_batch(batch)).jaxpr
  pipeline = trainer.strategy.pipeline
  loops = [eqn for eqn in _equations(jaxpr.jaxpr) if eqn.primitive.name == "scan"
           and eqn.params["length"] == pipeline.iterations]
  # The schedule's loop carries the stages' activations [stages, microbatch, length, embed]
  # (and the segment ids that travel with them, int32).
  carried = [v.aval for loop in loops for v in loop.outvars
             if getattr(v.aval, "shape", ())[:1] == (pipeline.stages,)
             and jnp.issubdtype(v.aval.dtype, jnp.floating)]
  assert carried and all(aval.dtype == jnp.bfloat16 for aval in carried), carried
  state = trainer.fit(token_batches(config), num_steps=STEPS, state=state).state
  assert state.params["blocks"]["wi"]["kernel"].value.dtype == jnp.float32
  assert np.isfinite(trainer.evaluate(state, token_batches(config))["loss"])


def _equations(jaxpr):
  """Every equation of a jaxpr and of the jaxprs inside it."""
  for eqn in jaxpr.eqns:
    yield eqn
    for param in eqn.params.values():
      for sub in param if isinstance(param, list | tuple) else [param]:
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          yield from _equations(inner)


# -- Refused before compiling -------------------------------------------------------------------


class DenseBlock(nn.Module):
  """A residual Dense layer; its kernel annotated, its bias not (as many Linen models do)."""

  @nn.compact
  def __call__(self, x):
    return x + nn.tanh(nn.Dense(x.shape[-1], kernel_init=nn.with_logical_partitioning(
        nn.initializers.lecun_normal(), ("embed", "mlp")))(x))


class DenseStackTrainer(Trainer):
  input_key, target_key = "inputs", "targets"

  def build_model(self):
    return _DenseStackModel()

  def loss(self, outputs, batch):
    return jnp.mean((outputs - batch["targets"]) ** 2, axis=-1)


class _DenseStackModel(nn.Module):
  @nn.compact
  def __call__(self, x):
    return models.LayerStack(DenseBlock, 4, name="blocks")(x)


def test_a_linen_stack_with_unannotated_biases_is_pipelined_like_a_single_device():
  batches = _vectors(STEPS)
  single = DenseStackTrainer(nnx_config(**{"strategy.name": "single_device"}))
  want = canonical(single, fit(single, batches))
  chaos = numerics.chaos_fits(single, batches, num_steps=STEPS,
                              view=lambda state: canonical(single, state))
  piped = DenseStackTrainer(nnx_config(**NNX_PIPE))
  state = fit(piped, batches)
  assert state.params["blocks"]["Dense_0"]["kernel"].value.sharding.spec[0] == "stage"
  assert state.params["blocks"]["Dense_0"]["bias"].shape == (4, 8)  # Whole on every stage.
  numerics.assert_equivalent(canonical(piped, state), want, chaos)


class BatchNormBlock(nn.Module):
  train: bool = True

  @nn.compact
  def __call__(self, x):
    y = nn.Dense(x.shape[-1], kernel_init=nn.with_logical_partitioning(
        nn.initializers.lecun_normal(), ("embed", "mlp")))(x)
    return x + nn.BatchNorm(use_running_average=not self.train)(y)


class BatchNormStackTrainer(Trainer):
  input_key, target_key = "inputs", "targets"

  def build_model(self):
    return _BatchNormStackModel()

  def loss(self, outputs, batch):
    return jnp.mean((outputs - batch["targets"]) ** 2, axis=-1)


class _BatchNormStackModel(nn.Module):
  train: bool = True  # Set by the Trainer, as on the Flax examples' models.

  @nn.compact
  def __call__(self, x):
    return models.LayerStack(BatchNormBlock, 4, {"train": self.train}, name="blocks")(x)


def _vectors(num=1):
  rng = np.random.default_rng(0)
  return [{"inputs": rng.normal(size=(16, 8)).astype(np.float32),
           "targets": rng.normal(size=(16, 8)).astype(np.float32)} for _ in range(num)]


def test_a_batchnorm_inside_a_pipelined_stack_is_refused_and_runs_unpipelined():
  config = nnx_config(**NNX_PIPE)
  with pytest.raises(PipelineError, match=r"holds 'batch_stats' variables"):
    BatchNormStackTrainer(config).fit(_vectors(), num_steps=1)
  # Under every other strategy the stack is a scan, BatchNorm's statistics stacked too.
  trainer = BatchNormStackTrainer(nnx_config(**{"strategy.name": "single_device"}))
  state = trainer.fit(_vectors(), num_steps=1).state
  assert state.model_state["batch_stats"]["blocks"]["BatchNorm_0"]["mean"].shape == (4, 8)


def test_an_nnx_batchnorm_inside_a_pipelined_stack_is_refused():
  from flax import nnx

  class Block(nnx.Module):
    def __init__(self, rngs):
      self.norm = nnx.BatchNorm(8, rngs=rngs)

    def __call__(self, x):
      return x + self.norm(x)

  stack = models.NnxLayerStack(Block, 4, rngs=nnx.Rngs(0))
  with pytest.raises(PipelineError, match=r"holds variables a layer updates .*BatchNorm"):
    from strategies import pipeline
    with pipeline.active(Pipeline(stages=1, microbatches=2, axis=None)):
      stack(jnp.ones((4, 8)))


REFUSALS = {
    "fewer microbatches than stages": (
        {"strategy.pipeline.microbatches": 2},
        r"config.strategy.pipeline.microbatches=2 is fewer than the 4 stages"),
    "layers that do not split into the stages": (
        {"model.num_layers": 6},
        r"has 6 layers, which do not split into 4 stages x 1 repeats"),
    "no layer -> stage rule": (
        {"strategy.logical_axis_rules": rules()},
        r"maps 'layer' to None: add the rule \('layer', 'stage'\)"),
    "the batch on the stage axis": (
        {"strategy.logical_axis_rules": (("batch", ("data", "stage")),) + rules(layer="stage")[1:]},
        r"maps \['batch'\] to the 'stage' axis"),
    "explicit axis types": (
        {"strategy.axis_types": "explicit"}, r"runs under 'auto' axis types only"),
    "a batch that does not cut into microbatches per data shard": (
        {"batch_size": 24}, r"a batch of 24 rows does not cut into "
                            r"config.strategy.pipeline.microbatches=8 microbatches"),
    "pipeline fields without a stage axis": (
        {"strategy.mesh_shape": (-1,), "strategy.mesh_axes": ("data",),
         "strategy.logical_axis_rules": rules()},
        r"pipeline.microbatches=8 is set, but the mesh axes \('data',\) have no 'stage'"),
    "pipeline fields under an ensemble": (
        {"strategy.name": "sharded_ensemble"},
        r"config.strategy.name='sharded_ensemble' trains an ensemble"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_what_cannot_be_pipelined_is_refused_before_compiling(case):
  overrides, message = REFUSALS[case]
  config = lm_config(**overrides)
  with pytest.raises(PipelineError, match=message):
    trainer = LanguageModelTrainer(config)
    trainer.init_state(token_batches(config, 1)[0])


def test_a_model_without_a_layer_stack_is_refused_under_a_stage_axis():
  from conftest import CNNTrainer, MLPTrainer, cnn_config, image_batches, mlp_config, vector_batches
  trainer = CNNTrainer(cnn_config(**{"strategy.name": "sharded_data_parallel", **PIPE}))
  with pytest.raises(PipelineError, match=r"no parameter has a leading 'layer' axis"):
    trainer.init_state(image_batches(1, 16)[0])
  # Layers named 'layer' by the model's own nn.scan: refused when the step is traced.
  trainer = MLPTrainer(mlp_config(**{
      "strategy.name": "sharded_data_parallel", **PIPE, "model.num_layers": 4,
      "strategy.logical_axis_rules": (
          ("batch", "data"), ("layer", "stage"), ("embed", None), ("hidden", None))}))
  batches = vector_batches(1, 16, 8)
  with pytest.raises(PipelineError, match=r"the step ran no layer stack"):
    trainer.fit(batches, num_steps=1)


def test_the_stacked_decoder_holds_its_layers_as_one_stacked_tree():
  from flax import nnx
  with nnx.use_eager_sharding(False):
    model = StackedDecoder(layers=4, rngs=nnx.Rngs(0))
  assert model.blocks.layers.up.kernel.shape == (4, 16, 32)
  assert model.blocks.layers.up.kernel.get_metadata()["out_sharding"] == ("layer", "embed", "mlp")
  assert model.blocks.layers.norm1.scale.get_metadata()["out_sharding"] == ("layer", None)
