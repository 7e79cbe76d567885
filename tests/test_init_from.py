"""Partial restore (`config.init_from`): a new run's variables from an earlier run's, by rules.

Loaded variables equal the source's bitwise under every strategy, BatchNorm
statistics follow the same rules, unmapped paths keep the fresh initialisation,
the optimizer (and EMA) state starts from the loaded values, and the run then
checkpoints and resumes exactly. Rules that cannot work are refused before
training, naming the paths and shapes.
"""

import os

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import user_models
from conftest import ALL_STRATEGIES as STRATEGIES
from conftest import CNNTrainer, cnn_config, image_batches
from flax import serialization

from trainer.checkpoint import Checkpointer

BATCHES = image_batches(4, 16)


def _flat(tree):
  return {jax.tree_util.keystr(p): np.asarray(x)
          for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def _pretrain(directory, trainer_cls, steps=3, **overrides):
  trainer = trainer_cls(cnn_config(**overrides))
  checkpointer = Checkpointer(directory, every_steps=0, async_save=False)
  state = trainer.fit(BATCHES, num_steps=steps, checkpointer=checkpointer).state
  checkpointer.close()
  return trainer.strategy.to_canonical(state)


@pytest.fixture(scope="module")
def flax_style(tmp_path_factory):
  """A Flax-examples-style model (BatchNorm over `batch`, dropout) trained 3 steps."""
  directory = str(tmp_path_factory.mktemp("flax_style") / "checkpoints")
  return directory, _pretrain(directory, user_models.FlaxStyleTrainer)


@pytest.fixture(scope="module")
def cnn_ensemble(tmp_path_factory):
  """An ensemble of 4 CNNs (sharded_ensemble) trained 2 steps, in a workdir."""
  workdir = tmp_path_factory.mktemp("cnn_ensemble")
  return str(workdir), _pretrain(str(workdir / "checkpoints"), CNNTrainer, steps=2,
                                 **STRATEGIES["sharded_ensemble"])


def _start(trainer_cls, **overrides):
  trainer = trainer_cls(cnn_config(**overrides))
  return trainer, trainer.strategy.to_canonical(trainer.init_state(BATCHES[0]))


def _one(x, member=0):
  """Member `member` of an ensemble's array, or a single model's array."""
  return x[member] if x.ndim and x.shape[0] in (4, 8) and x.ndim > 1 else x


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_loaded_variables_equal_the_source_and_the_rest_start_fresh(flax_style, strategy):
  directory, old = flax_style
  overrides = {**STRATEGIES[strategy], "ema_decay": 0.9}
  _, fresh = _start(user_models.FlaxStyleTrainer, **overrides)
  trainer, new = _start(user_models.FlaxStyleTrainer, **overrides,
                        **{"init_from.path": directory, "init_from.fresh": ("Dense_1/.*",)})
  members = trainer.strategy.checkpoint_layout()["num_members"]
  for tree in ("params", "model_state", "ema_params"):
    source = _flat(old.params if tree == "ema_params" else getattr(old, tree))
    for path, x in _flat(getattr(new, tree)).items():
      for m in range(max(members, 1)):
        got = x[m] if members else x
        if "Dense_1" in path:  # The new head: as initialised without init_from.
          want = _flat(getattr(fresh, tree))[path]
          np.testing.assert_array_equal(got, want[m] if members else want, err_msg=path)
        else:  # Parameters, BatchNorm statistics and the EMA start from the source.
          np.testing.assert_array_equal(got, source[path], err_msg=f"{tree}{path}")
  assert not np.any(np.asarray(new.step))
  traces = [x for x in jax.tree.leaves(new.opt_state) if np.issubdtype(x.dtype, np.floating)]
  assert traces and not any(np.any(t) for t in traces)  # Momentum starts at zero.
  trainer.fit(BATCHES, num_steps=2)  # And it trains.


def test_an_ensemble_checkpoint_gives_one_member_or_each_its_own(cnn_ensemble):
  workdir, old = cnn_ensemble
  _, one = _start(CNNTrainer, **{"init_from.path": workdir, "init_from.member": 2})
  for path, x in _flat(one.params).items():
    np.testing.assert_array_equal(x, _flat(old.params)[path][2], err_msg=path)
  _, each = _start(CNNTrainer, **STRATEGIES["sharded_ensemble"], **{"init_from.path": workdir})
  for path, x in _flat(each.params).items():
    np.testing.assert_array_equal(x, _flat(old.params)[path], err_msg=path)
  _, all_from_one = _start(CNNTrainer, **STRATEGIES["pmap_ensemble"],
                           **{"init_from.path": workdir, "init_from.member": 1})
  for path, x in _flat(all_from_one.params).items():
    np.testing.assert_array_equal(x, np.broadcast_to(_flat(old.params)[path][1], x.shape))


def test_rules_map_a_linen_checkpoint_into_an_nnx_model(cnn_ensemble):
  workdir, old = cnn_ensemble
  rules = (("conv1/(.*)", r"Conv_0/\1"), ("conv2/(.*)", r"Conv_1/\1"),
           ("dense1/(.*)", r"Dense_0/\1"))
  _, fresh = _start(user_models.NnxCNNTrainer)
  _, new = _start(user_models.NnxCNNTrainer, **{"init_from.path": workdir,
                                                "init_from.member": 3, "init_from.rules": rules})
  names = {"conv1": "Conv_0", "conv2": "Conv_1", "dense1": "Dense_0"}
  for path, x in _flat(new.params).items():
    module = path.split("'")[1]
    if module in names:
      want = _flat(old.params)[path.replace(module, names[module])][3]
    else:  # dense2 matches no rule: fresh.
      want = _flat(fresh.params)[path]
    np.testing.assert_array_equal(x, want, err_msg=path)


def test_an_nnx_models_batchnorm_statistics_follow_the_rules(tmp_path):
  old = _pretrain(str(tmp_path / "ckpt"), user_models.NnxBatchNormTrainer)
  _, new = _start(user_models.NnxBatchNormTrainer, **{"init_from.path": str(tmp_path / "ckpt"),
                                                      "init_from.fresh": ("out/.*",)})
  for path, x in _flat(new.model_state).items():
    assert "norm" in path
    np.testing.assert_array_equal(x, _flat(old.model_state)[path], err_msg=path)
  assert np.any(_flat(old.model_state)["['norm']['var']"] != 1)  # Statistics did move.
  np.testing.assert_array_equal(new.params["dense"]["kernel"], old.params["dense"]["kernel"])


@pytest.mark.parametrize("form", ["orbax", "msgpack"])
def test_a_plain_flax_variables_tree_is_a_source(flax_style, tmp_path, form):
  _, old = flax_style
  variables = {"params": jax.tree.map(np.asarray, old.params),
               "batch_stats": jax.tree.map(np.asarray, old.model_state["batch_stats"])}
  path = str(tmp_path / "variables")
  if form == "orbax":
    with ocp.StandardCheckpointer() as saver:
      saver.save(path, variables)
  else:
    path += ".msgpack"
    with open(path, "wb") as f:
      f.write(serialization.to_bytes(variables))
  _, new = _start(user_models.FlaxStyleTrainer, **{"init_from.path": path})
  for tree in ("params", "model_state"):
    for p, x in _flat(getattr(new, tree)).items():
      np.testing.assert_array_equal(x, _flat(getattr(old, tree))[p], err_msg=p)


def test_a_partially_restored_run_resumes_exactly(flax_style, tmp_path):
  directory, _ = flax_style
  overrides = {"init_from.path": directory, "init_from.fresh": ("Dense_1/.*",)}

  def run(workdir, steps):
    trainer = user_models.FlaxStyleTrainer(cnn_config(**overrides))
    checkpointer = Checkpointer(str(workdir), every_steps=2, async_save=False)
    state = trainer.fit(lambda start: BATCHES[start:], num_steps=steps,
                        checkpointer=checkpointer).state
    checkpointer.close()
    return trainer.strategy.to_canonical(state)

  straight = run(tmp_path / "straight", 4)
  run(tmp_path / "stopped", 2)
  resumed = run(tmp_path / "stopped", 4)  # From its own step 2, not from init_from again.
  for path, x in _flat(straight).items():
    np.testing.assert_array_equal(_flat(resumed)[path], x, err_msg=path)


@pytest.mark.parametrize("overrides,message", [
    ({"init_from.rules": (("Encoder_.*", r"\g<0>"),)},
     r"config.init_from.rules\[0\]=\('Encoder_.\*', '\\\\g<0>'\) matches no variable of the new "
     r"model; its paths are \['BatchNorm_0/bias'"),
    ({"init_from.fresh": ("Head/.*",)},
     r"config.init_from.fresh pattern 'Head/.\*' matches no variable"),
    ({"init_from.rules": (("Dense_.*", r"\g<0>"), (".*/kernel", r"\g<0>"))},
     r"params path 'Dense_0/kernel' is mapped twice, by rules \[\('Dense_.\*', '\\\\g<0>'\), "
     r"\('.\*/kernel', '\\\\g<0>'\)\]"),
    ({"init_from.rules": (("Dense_1/(.*)", r"Head/\1"), ("(Dense_0|BatchNorm_0)/.*", r"\g<0>"))},
     r"maps params path 'Dense_1/bias' \(shape \(10,\)\) to 'Head/bias', which checkpoint step "
     r"3 in .* does not hold; its params paths include"),
    ({"init_from.rules": (("Dense_1/(.*)", r"Dense_0/\1"), ("(Dense_0|BatchNorm_0)/.*", r"\g<0>"))},
     r"params path 'Dense_1/bias' has shape \(10,\) in the new model but 'Dense_0/bias' has "
     r"shape \(16,\) in checkpoint step 3"),
    ({"init_from.step": 7}, r"config.init_from.step=7 is not a checkpoint in .*; its complete "
                            r"checkpoints are steps \[3\]"),
    ({"init_from.member": 0}, r"config.init_from.member=0 but checkpoint step 3 .* holds a "
                              r"single model"),
])
def test_rules_that_cannot_work_are_refused_before_training(flax_style, tmp_path, overrides,
                                                           message):
  directory, _ = flax_style
  workdir = tmp_path / "new"
  with pytest.raises(ValueError, match=message):
    trainer = user_models.FlaxStyleTrainer(cnn_config(**{"init_from.path": directory},
                                                      **overrides))
    trainer.fit(BATCHES, num_steps=2, checkpointer=Checkpointer(str(workdir)))
  assert not os.path.exists(workdir)  # Nothing trained, nothing written.


def test_an_ensemble_source_needs_a_member_for_a_different_layout(cnn_ensemble):
  workdir, _ = cnn_ensemble
  with pytest.raises(ValueError, match=r"holds an ensemble of 4 members and the new run holds "
                                       r"one model; set config.init_from.member"):
    _start(CNNTrainer, **{"init_from.path": workdir})
  with pytest.raises(ValueError, match=r"config.init_from.member=4 is out of range"):
    _start(CNNTrainer, **{"init_from.path": workdir, "init_from.member": 4})


def test_a_path_that_does_not_exist_is_refused_when_the_trainer_is_built(tmp_path):
  with pytest.raises(ValueError, match=r"config.init_from.path='.*/nowhere' does not exist"):
    CNNTrainer(cnn_config(**{"init_from.path": str(tmp_path / "nowhere")}))


def test_every_shape_mismatch_is_named_with_both_shapes(flax_style, tmp_path):
  """Mapping the head onto the hidden layer mismatches two arrays: both are named."""
  directory, _ = flax_style
  rules = (("Dense_1/(.*)", r"Dense_0/\1"), ("(Dense_0|BatchNorm_0)/.*", r"\g<0>"))
  with pytest.raises(ValueError) as info:
    user_models.FlaxStyleTrainer(cnn_config(**{"init_from.path": directory,
                                               "init_from.rules": rules})).init_state(BATCHES[0])
  message = str(info.value)
  assert "2 variable(s) of the new model differ in shape" in message, message
  for new, old, new_shape, old_shape in (("Dense_1/bias", "Dense_0/bias", (10,), (16,)),
                                         ("Dense_1/kernel", "Dense_0/kernel", (16, 10),
                                          (784, 16))):
    assert (f"params path {new!r} has shape {new_shape} in the new model but {old!r} has "
            f"shape {old_shape}") in message, message
