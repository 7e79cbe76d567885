"""Frozen parameters and parameter groups (`config.freeze`, `config.param_groups`).

Frozen parameters stay bitwise unchanged under every strategy and carry no
optimizer state; a group's learning-rate multiplier scales exactly its own
parameters' updates; patterns that cannot work are refused naming the paths.
"""

import jax
import numpy as np
import pytest
import user_models
from conftest import ALL_STRATEGIES as STRATEGIES
from conftest import CNNTrainer, cnn_config, image_batches

from strategies.single_device import SingleDevice
from trainer.checkpoint import Checkpointer
from trainer.sweep import export_member

CONVS = ("Conv_.*",)


def _train(steps=3, **overrides):
  trainer = CNNTrainer(cnn_config(**overrides))
  batches = image_batches(steps, 16)
  initial = trainer.strategy.to_canonical(trainer.init_state(batches[0]))
  final = trainer.strategy.to_canonical(trainer.fit(batches, num_steps=steps).state)
  return trainer, initial, final


def _by_path(tree):
  return {jax.tree_util.keystr(p): np.asarray(x)
          for p, x in jax.tree_util.tree_leaves_with_path(tree)}


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_frozen_parameters_stay_bitwise_and_carry_no_optimizer_state(strategy):
  _, initial, final = _train(**STRATEGIES[strategy], freeze=CONVS, grad_accum_steps=2,
                             ema_decay=0.9, grad_clip_norm=1.0)
  before, after = _by_path(initial.params), _by_path(final.params)
  for path in before:
    if "Conv_" in path:
      np.testing.assert_array_equal(after[path], before[path], err_msg=path)
    else:
      assert not np.array_equal(after[path], before[path]), path
  ema = _by_path(final.ema_params)
  for path in before:
    if "Conv_" in path:  # The average of an unchanged parameter is that parameter
      # (to round-off: 0.9 * p + 0.1 * p is not always p's bits).
      np.testing.assert_allclose(ema[path], before[path], rtol=1e-6, atol=1e-7, err_msg=path)
  # SGD with momentum: a trace per trainable parameter, none for the frozen ones.
  trace_sizes = sorted(x.size for x in jax.tree.leaves(final.opt_state)
                       if np.issubdtype(x.dtype, np.floating))  # Not the step counts.
  dense_sizes = sorted(x.size for p, x in before.items() if "Dense_" in p)
  assert trace_sizes == dense_sizes


def test_an_nnx_models_parameters_freeze_by_their_paths():
  trainer = user_models.NnxCNNTrainer(cnn_config(freeze=("conv.*",)))
  batches = image_batches(3, 16)
  before = _by_path(trainer.strategy.to_canonical(trainer.init_state(batches[0]).params))
  after = _by_path(trainer.strategy.to_canonical(trainer.fit(batches, num_steps=3).state.params))
  assert {p for p in before if "conv" in p} and {p for p in before if "dense" in p}
  for path in before:
    if "conv" in path:
      np.testing.assert_array_equal(after[path], before[path], err_msg=path)
    else:
      assert not np.array_equal(after[path], before[path]), path


def test_freezing_equals_a_zero_learning_rate_for_those_parameters():
  _, _, frozen = _train(freeze=CONVS)
  _, _, zero = _train(param_groups=({"pattern": "Conv_.*", "lr_scale": 0.0},))
  for path, x in _by_path(frozen.params).items():
    np.testing.assert_array_equal(_by_path(zero.params)[path], x, err_msg=path)


def test_a_groups_learning_rate_multiplier_scales_exactly_its_updates():
  plain = {"momentum": 0.0}  # One SGD step: the update is -lr * gradient.
  _, initial, base = _train(steps=1, **plain)
  _, _, scaled = _train(steps=1, **plain,
                        param_groups=({"pattern": "Dense_1/.*", "lr_scale": 2.0},))
  start, one, two = _by_path(initial.params), _by_path(base.params), _by_path(scaled.params)
  for path in start:
    if path.startswith("['Dense_1']"):
      np.testing.assert_allclose(two[path] - start[path], 2.0 * (one[path] - start[path]),
                                 rtol=1e-5, atol=1e-7, err_msg=path)  # p + u rounds.
    else:
      np.testing.assert_array_equal(two[path], one[path], err_msg=path)


@pytest.mark.parametrize("overrides,message", [
    ({"freeze": ("Encoder_.*",)},
     r"config.freeze pattern 'Encoder_.\*' matches no parameter; the parameters are "
     r"\['Conv_0/bias', 'Conv_0/kernel'"),
    ({"freeze": ("Conv_0/.*",), "param_groups": ({"pattern": "Conv_0/kernel"},)},
     r"parameter 'Conv_0/kernel' is claimed by config.freeze pattern 'Conv_0/.\*' and by "
     r"config.param_groups\[0\] pattern 'Conv_0/kernel'"),
    ({"param_groups": ({"pattern": "Conv_.*", "lr": 0.1},)},
     r"config.param_groups\[0\]=.* must have a 'pattern' and may have 'lr_scale' and "
     r"'weight_decay' \(got \['lr'\] besides\)"),
    ({"param_groups": ({"pattern": "Conv_.*", "lr": 0.1},), "strategy.name": "sharded_ensemble",
      "ensemble_size": 0, "sweep.grid.learning_rate": (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)},
     r"config.param_groups\[0\]=.* must have a 'pattern' and may have 'lr_scale' and "
     r"'weight_decay' \(got \['lr'\] besides\)"),
])
def test_groups_that_cannot_work_are_refused_before_training(overrides, message):
  with pytest.raises(ValueError, match=message):
    trainer = CNNTrainer(cnn_config(**overrides))
    trainer.init_state(image_batches(1, 16)[0])


def test_a_sweep_with_frozen_parameters_and_groups_trains_each_members_single_run(tmp_path):
  """Each member of a sweep (its rate and clip norm) with the first layer frozen and the
  head's rate doubled equals the single-device run of its config, groups included; the
  exported member restores into that run's optimizer layout."""
  config = cnn_config(**{
      "strategy.name": "sharded_ensemble", "ensemble_size": 0,
      "strategy.ensemble_mesh_shape": (4, 1), "freeze": ("Dense_0/.*",),
      "param_groups": ({"pattern": "Dense_1/.*", "lr_scale": 2.0, "weight_decay": 0.01},),
      "sweep.grid.learning_rate": (0.1, 0.03), "sweep.grid.grad_clip_norm": (0.0, 0.5)})
  trainer = user_models.FlaxStyleTrainer(config)
  batches = image_batches(3, 16)
  state = trainer.fit(batches, num_steps=3).state
  swept = trainer.strategy.to_canonical(state)
  for i in range(len(trainer.sweep)):
    single = user_models.FlaxStyleTrainer(trainer.sweep.member_config(config, i),
                                          strategy=SingleDevice())
    initial = single.strategy.to_canonical(single.init_state(batches[0]))
    want = single.strategy.to_canonical(single.fit(batches, num_steps=3).state)
    for path, x in _by_path(want.params).items():
      np.testing.assert_allclose(_by_path(swept.params)[path][i], x, rtol=1e-5, atol=1e-6,
                                 err_msg=f"{trainer.sweep.label(i)} {path}")
      if "Dense_0" in path:
        np.testing.assert_array_equal(x, _by_path(initial.params)[path])
  export_member(state, 3, str(tmp_path / "member3"), sweep=trainer.sweep, config=config,
                strategy=trainer.strategy, num_train_steps=trainer.num_train_steps,
                labels=trainer.labels)
  restored = single.restore_checkpoint(Checkpointer(str(tmp_path / "member3")), batches[0])
  for path, x in _by_path(restored.params).items():
    np.testing.assert_array_equal(x, _by_path(swept.params)[path][3], err_msg=path)
