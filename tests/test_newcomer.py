"""What a new user meets first, tried as one would: each mistake gets an error or warning that
says what to change, and Flax's own NNX example model trains as written."""

import logging
import os

import jax
import numpy as np
import pytest
import tensorflow_datasets as tfds
import user_models as um
from conftest import cnn_config, image_batches, leaves

from trainer import ClassificationTrainer
from trainer import data as data_lib
from trainer.checkpoint import Checkpointer
from trainer.step.model_variables import MissingRngStreamError

# -- An RNG stream the Trainer does not draw ----------------------------------------------------


class ReadsAStreamItLacks(um.NoisyTrainer):
  rng_streams = ("dropout", "noise")  # model_inputs reads rngs['z'].


def test_a_missing_rng_stream_names_rng_streams_not_the_batch():
  trainer = ReadsAStreamItLacks(cnn_config())
  with pytest.raises(MissingRngStreamError, match=r"RNG stream 'z'.*add 'z' to the Trainer "
                                                  r"subclass's rng_streams") as info:
    trainer.fit(image_batches(1, 16), num_steps=1)
  assert "input_key" not in str(info.value)  # Not reported as a batch entry.


# -- Flax's NNX MNIST CNN, verbatim -----------------------------------------------------------


def _no_dropout(*, rngs):
  """The same model with its dropout off: pmap DP draws a mask per replica by design."""
  model = um.FlaxNnxMnistCNN(rngs=rngs)
  model.dropout1.rate = model.dropout2.rate = 0.0
  return model


class NoDropoutTrainer(ClassificationTrainer):
  def build_model(self):
    return _no_dropout


def test_flax_nnx_mnist_cnn_takes_rngs_in_call_and_trains():
  batches = image_batches(3, 16)
  trainer = um.FlaxNnxMnistTrainer(cnn_config(eval_every_steps=0))
  result = trainer.fit(batches, num_steps=3, eval_batches=lambda: batches)
  assert np.isfinite(result.final_eval["nll"])
  # The dropout draws come from the step's streams: the same run again is the same run.
  again = um.FlaxNnxMnistTrainer(cnn_config()).fit(batches, num_steps=3).state
  for a, b in zip(leaves(result.state.params), leaves(again.params), strict=True):
    np.testing.assert_array_equal(a, b)


def test_batchnorm_without_axis_name_is_refused_under_pmap_with_the_switch_named():
  trainer = um.FlaxNnxMnistTrainer(cnn_config(**{"strategy.name": "pmap_data_parallel"}))
  with pytest.raises(ValueError, match=r"batch_norm1.*config.sync_batchnorm=True"):
    trainer.fit(image_batches(1, 16), num_steps=1)


def test_sync_batchnorm_makes_the_verbatim_model_equal_single_device_under_pmap():
  batches = image_batches(3, 16)
  um.FlaxNnxMnistTrainer(cnn_config(**{"strategy.name": "pmap_data_parallel",
                                       "sync_batchnorm": True})).fit(batches, num_steps=1)
  runs = {}
  for name in ("single_device", "pmap_data_parallel"):
    trainer = NoDropoutTrainer(cnn_config(**{"strategy.name": name, "sync_batchnorm": True}))
    state = trainer.fit(batches, num_steps=3).state
    runs[name] = trainer.strategy.to_canonical({"params": state.params,
                                                "model_state": state.model_state})
  assert jax.tree.leaves(runs["single_device"]["model_state"])
  for a, b in zip(leaves(runs["pmap_data_parallel"]), leaves(runs["single_device"]),
                  strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_sync_batchnorm_binds_a_linen_batchnorm_too():
  class LocalBNTrainer(ClassificationTrainer):
    def build_model(self):
      return um.LocalBatchNorm()

  batches = image_batches(2, 16)
  with pytest.raises(ValueError, match="sync_batchnorm"):
    LocalBNTrainer(cnn_config(**{"strategy.name": "pmap_data_parallel"})).fit(
        batches, num_steps=1)
  runs = []
  for name in ("single_device", "pmap_data_parallel"):
    trainer = LocalBNTrainer(cnn_config(**{"strategy.name": name, "sync_batchnorm": True}))
    state = trainer.fit(batches, num_steps=2).state
    runs.append(trainer.strategy.to_canonical((state.params, state.model_state)))
  for a, b in zip(leaves(runs[1]), leaves(runs[0]), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


# -- A run shorter or longer than its schedule -------------------------------------------------


def test_fit_longer_than_the_decaying_schedule_fails_and_shorter_warns(caplog):
  config = cnn_config(**{"schedule.name": "cosine", "num_train_steps": 4})
  batches = image_batches(2, 16)
  with pytest.raises(ValueError, match=r"fit\(num_steps=12\) runs past the end of "
                                       r"config.schedule.name='cosine'.*num_train_steps=12"):
    um.ResNetTrainer(config).fit(batches * 6, num_steps=12)
  with caplog.at_level(logging.WARNING):
    um.ResNetTrainer(config).fit(batches, num_steps=2)
  assert "stops before config.schedule.name='cosine' has decayed" in caplog.text
  caplog.clear()
  with caplog.at_level(logging.WARNING):
    um.ResNetTrainer(config, num_train_steps=2).fit(batches, num_steps=2)
  assert "has decayed" not in caplog.text


# -- Gradient accumulation with BatchNorm: what it is, pinned ---------------------------------


def test_accumulation_with_batchnorm_normalises_per_microbatch_and_updates_stats_per_microbatch():
  """k microbatches are k forward passes: each normalises with its own batch statistics, and
  the running statistics take k updates in order (microbatch j holds rows j, j+k, ...). So
  the update is not the big-batch update, as in a hand-written Flax accumulation loop."""
  batch = image_batches(1, 16)[0]
  config = cnn_config(grad_accum_steps=2)
  trainer = um.ResNetTrainer(config)
  state = trainer.init_state(batch)
  initial = jax.device_get(state.model_state)
  params = jax.device_get(state.params)
  accumulated = jax.device_get(trainer.fit([batch], num_steps=1, state=state).state.model_state)

  def forward(model_state, rows):
    micro = {k: v[rows] for k, v in batch.items()}
    _, new = trainer.apply_model(params, model_state, micro, train=True,
                                 rngs=trainer.step_rngs(jax.random.PRNGKey(0)))
    return new

  in_order = forward(forward(initial, slice(0, None, 2)), slice(1, None, 2))
  big_batch = forward(initial, slice(None))
  for a, b in zip(leaves(accumulated), leaves(in_order), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  assert not all(np.allclose(a, b, rtol=1e-4) for a, b in zip(
      leaves(accumulated), leaves(big_batch), strict=True))


# -- Checkpoints, data and the console --------------------------------------------------------


def test_a_checkpointer_makes_no_directory_until_it_saves(tmp_path):
  ckpt = Checkpointer(tmp_path / "checkpoints", every_steps=1)
  assert ckpt.latest_step() is None
  ckpt.close()
  assert not (tmp_path / "checkpoints").exists()


def test_a_config_error_leaves_no_checkpoint_directory(tmp_path):
  import importlib
  import sys
  sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
  try:
    example = importlib.import_module("mnist_ensemble")
  finally:
    sys.path.pop(0)
  from configs import mnist_ensemble
  config = mnist_ensemble.get_config()
  config.batch_size = 12  # Does not split over pmap DP's 8 data replicas.
  config.strategy.name = "pmap_data_parallel"
  config.data.manual_dir = ""
  with tfds.testing.mock_data(num_examples=40), pytest.raises(ValueError, match="batch_size=12"):
    example.train_and_evaluate(config, str(tmp_path))
  assert not (tmp_path / "checkpoints").exists()


def test_offline_download_fails_at_once_naming_manual_dir(tmp_path, monkeypatch):
  with pytest.raises(OSError):
    data_lib.check_reachable("http://127.0.0.1:9/", timeout=2)  # Loopback: refused at once.
  monkeypatch.setattr(tfds.image_classification.MNIST, "URL", "http://127.0.0.1:9/mnist/")
  with pytest.raises(RuntimeError, match=r"config.data.manual_dir \(or the TFDS_MANUAL_DIR"):
    data_lib.prepare("mnist", str(tmp_path / "tfds"), None)


def test_orbax_info_lines_stay_off_the_console(tmp_path, caplog):
  from absl import logging as absl_logging
  trainer = um.ResNetTrainer(cnn_config())
  batches = image_batches(2, 16)
  ckpt = Checkpointer(tmp_path / "ckpt", every_steps=1)
  with caplog.at_level(logging.INFO):
    absl_logging.set_verbosity(absl_logging.INFO)
    trainer.fit(batches, num_steps=2, checkpointer=ckpt)
    ckpt.close()
  assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["1", "2"]
  shown = [r for r in caplog.records if r.levelno <= logging.INFO
           and os.sep + "orbax" + os.sep in r.pathname]
  assert not shown, [r.getMessage() for r in shown[:3]]

