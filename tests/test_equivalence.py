"""Data parallelism changes where the work runs, never the result.

pmap data parallel and jit over a mesh (1-D data mesh, and a 2x4 data x model
mesh with logical rules) must give the parameters a single device gives after
several steps on the same global batches, within the float32 noise of the computation
(`tests/numerics.py`: the single-device run from a perturbed init is the yardstick).
"""

import jax
import numerics
import numpy as np
import pytest
from conftest import (
  CNNTrainer,
  MLPTrainer,
  cnn_config,
  image_batches,
  leaves,
  mlp_config,
  vector_batches,
  xla_flags_naming_no_level,
)
from small_configs import tiny_lm_config

from configs import mlp_sharded
from strategies import Ensemble
from strategies.base import CPU_INIT_COMPILER_OPTIONS, cpu_compiler_options, init_compiler_options
from trainer import LanguageModelTrainer
from trainer.plan import CPU_PLAN_COMPILER_OPTIONS

STEPS = 4

DATA_PARALLEL = {
    "pmap_data_parallel": {"strategy.name": "pmap_data_parallel"},
    "sharded_data_8": {
        "strategy.name": "sharded_data_parallel", "strategy.mesh_shape": (8,),
        "strategy.mesh_axes": ("data",), "strategy.logical_axis_rules": (("batch", "data"),)},
    "sharded_data_model_2x4": {
        "strategy.name": "sharded_data_parallel", "strategy.mesh_shape": (2, 4),
        "strategy.mesh_axes": ("data", "model"),
        "strategy.logical_axis_rules": mlp_sharded.get_config().strategy.logical_axis_rules},
}

MODELS = {
    # (trainer class, config factory, batches)
    "cnn": (CNNTrainer, cnn_config, lambda: image_batches(STEPS, 16)),
    "mlp_sgd": (MLPTrainer, lambda **kw: mlp_config(optimizer="sgd", learning_rate=0.05, **kw),
                lambda: vector_batches(STEPS, 16, 8)),
    "mlp_adam": (MLPTrainer, mlp_config, lambda: vector_batches(STEPS, 16, 8)),
}


def _train(model: str, overrides: dict, *, chaos: bool = False):
  """The canonical parameters after STEPS steps (chaos: of the runs `numerics.chaos_fits`)."""
  trainer_cls, make_config, make_batches = MODELS[model]
  if model == "cnn" and "strategy.logical_axis_rules" in overrides:
    # The CNN annotates no parameter: a table that shards parameters is refused for it.
    overrides = {**overrides, "strategy.logical_axis_rules": (("batch", "data"),)}
  config = make_config(**overrides)
  trainer = trainer_cls(config)
  view = lambda state: trainer.strategy.to_canonical(state.params)  # noqa: E731
  if chaos:
    return numerics.chaos_fits(trainer, make_batches(), num_steps=STEPS, view=view)
  return view(trainer.fit(make_batches(), num_steps=STEPS).state)


@pytest.fixture(scope="module")
def reference():
  """model -> (the single-device parameters, the same run from a perturbed init)."""
  cache = {}

  def get(model):
    if model not in cache:
      single = {"strategy.name": "single_device"}
      cache[model] = (_train(model, single), _train(model, single, chaos=True))
    return cache[model]

  return get


@pytest.mark.parametrize("strategy", sorted(DATA_PARALLEL))
@pytest.mark.parametrize("model", sorted(MODELS))
def test_data_parallel_matches_single_device(model, strategy, reference):
  expected, chaos = reference(model)
  got = _train(model, DATA_PARALLEL[strategy])
  initial = _initial_params(model)
  numerics.assert_equivalent(got, expected, chaos)
  # The comparison is meaningful only if training moved the parameters.
  assert any(not np.allclose(w, s) for w, s in zip(leaves(expected), initial, strict=True))


def _initial_params(model):
  trainer_cls, make_config, make_batches = MODELS[model]
  trainer = trainer_cls(make_config(**{"strategy.name": "single_device"}))
  return leaves(trainer.init_state(make_batches()[0]).params)


# -- A state's init program -----------------------------------------------------------------

INITS = {
    # A Linen CNN (truncated-normal kernels, zero biases) under data and ensemble layouts.
    "cnn-single_device": (CNNTrainer, cnn_config, {"strategy.name": "single_device"}),
    "cnn-pmap_data_parallel": (CNNTrainer, cnn_config, {"strategy.name": "pmap_data_parallel"}),
    "cnn-pmap_ensemble": (CNNTrainer, cnn_config, {"strategy.name": "pmap_ensemble",
                                                   "ensemble_size": 8}),
    "cnn-sharded_ensemble": (CNNTrainer, cnn_config, {
        "strategy.name": "sharded_ensemble", "ensemble_size": 8,
        "strategy.ensemble_mesh_shape": (4, 2)}),
    # The project's decoder (normal embeddings, scaled projections), every weight sharded.
    "lm-fsdp": (LanguageModelTrainer, lambda **kw: tiny_lm_config("fsdp", **kw), {}),
}


#: XLA:CPU's LLVM optimization level when neither a flag nor a program's options set one.
XLA_DEFAULT_LEVEL = 3


@pytest.mark.parametrize("case", sorted(INITS))
def test_a_state_holds_the_values_of_its_init_compiled_at_xlas_defaults(case, monkeypatch):
  """On XLA:CPU a state's init program compiles at LLVM's optimization level 1
  (`strategies.base.init_compiler_options`: it runs once). Its values are those of the
  same program compiled with XLA's defaults, to the bit: without fast math, what level 3
  adds (vectorizing, unrolling) reorders no floating-point operation."""
  # As a user's process that names no level: the tests' XLA_FLAGS name one (conftest.py),
  # which the init program would otherwise take (`test_a_level_the_xla_flags_set_...`).
  monkeypatch.setenv("XLA_FLAGS", xla_flags_naming_no_level())
  trainer_cls, make_config, overrides = INITS[case]
  trainer = trainer_cls(make_config(**overrides))
  strategy = trainer.strategy
  if case.startswith("lm"):
    batch = {"inputs": np.zeros((16, 16), np.int32), "targets": np.zeros((16, 16), np.int32)}
  else:
    batch = image_batches(1, 16)[0]
  assert init_compiler_options(jax.devices()) == CPU_INIT_COMPILER_OPTIONS
  rng = jax.random.PRNGKey(trainer.config.seed)
  got = strategy.to_canonical(trainer.init_state(batch).params)
  # XLA's default level, named: the tests' own XLA_FLAGS (conftest.py) set level 0 for every
  # other program, which would compare the init with a program compiled as it was.
  defaults = jax.jit(trainer.states.steps.init_fn(batch),
                     compiler_options={"xla_backend_optimization_level": XLA_DEFAULT_LEVEL})
  if isinstance(strategy, Ensemble):
    members = [defaults(r).params for r in strategy.member_rngs(rng)]
    want = jax.tree.map(lambda *xs: np.stack(xs), *members)
  else:
    want = defaults(rng).params
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(want), leaves(got),
                          strict=True):
    np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=jax.tree_util.keystr(path))
  assert any(np.asarray(a).std() > 0 for a in leaves(got))  # Random, not all zeros.


def test_a_level_the_xla_flags_set_holds_for_the_init_and_dry_run_programs(monkeypatch):
  """`cpu_compiler_options` leaves out an option the process's XLA_FLAGS set: a user who
  names an optimization level gets it for a state's init and the dry run's step too."""
  cpu = jax.devices()[:1]
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  assert init_compiler_options(cpu) == CPU_INIT_COMPILER_OPTIONS
  assert cpu_compiler_options(cpu, CPU_PLAN_COMPILER_OPTIONS) == CPU_PLAN_COMPILER_OPTIONS
  monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=3 --xla_cpu_max_isa=AVX")
  assert init_compiler_options(cpu) is None
  both = {"xla_backend_optimization_level": 1, "xla_cpu_enable_fast_math": False}
  assert cpu_compiler_options(cpu, both) == {"xla_cpu_enable_fast_math": False}

  class Gpu:
    platform = "gpu"

  monkeypatch.delenv("XLA_FLAGS")
  assert cpu_compiler_options([Gpu()], CPU_INIT_COMPILER_OPTIONS) is None
