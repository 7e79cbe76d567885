"""What a new user meets first, tried as one would: each mistake gets an error or warning that
says what to change, and Flax's own NNX example model trains as written."""

import logging
import os
import pathlib
import re

import jax
import numerics
import numpy as np
import process_cache
import pytest
import tensorflow_datasets as tfds
import user_models as um
from conftest import cnn_config, image_batches, leaves, mock_tfds
from flax import nnx

from trainer import ClassificationTrainer
from trainer import data as data_lib
from trainer.checkpoint import Checkpointer
from trainer.step.model_variables import MissingRngStreamError

ROOT = pathlib.Path(__file__).resolve().parents[1]

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
  for name in ("pmap_data_parallel", "single_device"):  # The chaos runs are the last one's.
    trainer = NoDropoutTrainer(cnn_config(**{"strategy.name": name, "sync_batchnorm": True}))
    view = lambda state, trainer=trainer: trainer.strategy.to_canonical(  # noqa: E731
        {"params": state.params, "model_state": state.model_state})
    runs[name] = view(trainer.fit(batches, num_steps=3).state)
  # The yardstick of float32 noise (tests/numerics.py): the reference from a perturbed init.
  runs["chaos"] = numerics.chaos_fits(trainer, batches, num_steps=3, view=view)
  assert jax.tree.leaves(runs["single_device"]["model_state"])
  numerics.assert_equivalent(runs["pmap_data_parallel"], runs["single_device"], runs["chaos"])


def test_sync_batchnorm_binds_a_linen_batchnorm_too():
  class LocalBNTrainer(ClassificationTrainer):
    def build_model(self):
      return um.LocalBatchNorm()

  batches = image_batches(2, 16)
  with pytest.raises(ValueError, match="sync_batchnorm"):
    LocalBNTrainer(cnn_config(**{"strategy.name": "pmap_data_parallel"})).fit(
        batches, num_steps=1)
  runs = []
  for name in ("pmap_data_parallel", "single_device"):  # The chaos runs are the last one's.
    trainer = LocalBNTrainer(cnn_config(**{"strategy.name": name, "sync_batchnorm": True}))
    view = lambda state, trainer=trainer: trainer.strategy.to_canonical(  # noqa: E731
        (state.params, state.model_state))
    runs.append(view(trainer.fit(batches, num_steps=2).state))
  chaos = numerics.chaos_fits(trainer, batches, num_steps=2, view=view)
  numerics.assert_equivalent(runs[0], runs[1], chaos)


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
  with mock_tfds(40), pytest.raises(ValueError, match="batch_size=12"):
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



# -- Traps found from outside (issue 14) --------------------------------------------------------


class TakesRngsInCall(nnx.Module):
  """As Flax's NNX examples write a model with dropout: `rngs` a `__call__` argument."""

  def __init__(self, *, rngs: nnx.Rngs):
    self.linear = nnx.Linear(784, 10, rngs=rngs)
    self.dropout = nnx.Dropout(rate=0.5)

  def __call__(self, x, rngs: nnx.Rngs | None = None):
    return self.linear(self.dropout(x.reshape(x.shape[0], -1), rngs=rngs))


class BindsRngsItself(ClassificationTrainer):
  def build_model(self):
    return TakesRngsInCall


class PassesRngsPositionally(BindsRngsItself):
  """What the README told users before issue 9: `nnx.Rngs` as `__call__`'s second argument."""

  def model_inputs(self, batch, *, train, rngs):
    return (batch[self.input_key], nnx.Rngs(dropout=rngs["dropout"])), {}


def test_an_nnx_model_given_rngs_positionally_is_not_given_them_twice():
  batches = image_batches(2, 16)
  positional = PassesRngsPositionally(cnn_config()).fit(batches, num_steps=2).state
  # The trainer's own binding draws from the same stream key: the same run.
  own = BindsRngsItself(cnn_config()).fit(batches, num_steps=2).state
  for a, b in zip(leaves(positional.params), leaves(own.params), strict=True):
    np.testing.assert_array_equal(a, b)
  initial = BindsRngsItself(cnn_config()).init_state(batches[0])
  assert not np.array_equal(leaves(own.params)[0], leaves(initial.params)[0])  # It trained.


class JitsItsOwnRngFunction(ClassificationTrainer):
  """A hook that hands the step's `rngs` to a jitted function of its own."""

  rng_streams = ("dropout", "noise")

  def build_model(self):
    return um.FlaxStyleNet()

  def model_inputs(self, batch, *, train, rngs):
    noisy = jax.jit(lambda images, r: images + 0.01 * jax.random.normal(
        r["noise"], images.shape))(batch["image"], rngs)
    return (noisy,), {}


def test_step_rngs_pass_into_the_users_own_jit_and_a_missing_stream_is_still_named():
  trainer = JitsItsOwnRngFunction(cnn_config())
  rngs = trainer.step_rngs(jax.random.PRNGKey(0))
  leaves_of = jax.tree_util.tree_leaves_with_path(rngs)
  assert [jax.tree_util.keystr(p) for p, _ in leaves_of] == ["['dropout']", "['noise']"]
  result = trainer.fit(image_batches(2, 16), num_steps=2)
  assert np.isfinite(leaves(result.state.params)[0]).all()
  with pytest.raises(MissingRngStreamError, match=r"RNG stream 'z'"):
    jax.jit(lambda r: r["z"])(rngs)


def _run_example(args, tmp_path, script="examples/mnist_ensemble.py"):
  import subprocess
  import sys
  env = process_cache.launched_env(TFDS_DATA_DIR=str(tmp_path / "tfds"))
  return subprocess.run([sys.executable, script, *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300)


def test_a_workdir_that_is_a_file_is_refused_naming_the_flag_before_data_is_read(tmp_path):
  afile = tmp_path / "results.txt"
  afile.write_text("not a directory")
  for workdir in (afile, afile / "run"):
    result = _run_example([f"--workdir={workdir}"], tmp_path)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "FATAL Flags parsing error" in result.stderr
    assert re.search(r"--workdir=\S*results.txt.*(is a file|cannot be made).*must be a "
                     r"directory", result.stderr), result.stderr[-3000:]
    assert "Traceback" not in result.stderr
  assert not (tmp_path / "tfds").exists()  # Nothing was read or prepared.
  assert afile.read_text() == "not a directory"


def test_a_field_that_cannot_be_swept_names_what_can_and_what_to_do(tmp_path):
  result = _run_example(["--config=configs/mnist_sweep.py", f"--workdir={tmp_path}/w",
                         "--config.sweep.grid.dropout_rate=0.1,0.2"], tmp_path)
  assert result.returncode == 1
  assert re.search(r"--config.sweep.grid.dropout_rate: 'dropout_rate' cannot be swept; the "
                   r"names a sweep can vary are \['b1', 'beta', 'ema_decay', 'grad_clip_norm', "
                   r"'learning_rate', 'momentum', 'warmup_steps', 'weight_decay'\].*module "
                   r"hyperparameter.*one run per value", result.stderr), result.stderr[-3000:]
  assert "Traceback" not in result.stderr


@pytest.mark.parametrize("args,message", [
    # No --config: ml_collections applies overrides to the default while defining the flag.
    (["--config.learning_rat=0.1"],
     r"--config.learning_rat: config has no field 'learning_rat' \(did you mean "
     r"\['learning_rate'\]\?\)"),
    (["--config=configs/mnist_sweep.py", "--config.optimizer.name=adam"],
     r"--config.optimizer.name: config.optimizer is a value, not a section"),
])
def test_a_mistyped_override_names_the_field_and_what_is_there(tmp_path, args, message):
  result = _run_example([*args, f"--workdir={tmp_path}/w"], tmp_path)
  assert result.returncode == 1
  assert re.search(message, result.stderr), result.stderr[-3000:]
  assert "Traceback" not in result.stderr


# -- The first screen ---------------------------------------------------------------------------


def test_the_stacks_start_up_notices_are_kept_off_the_console_unless_asked_for():
  """jax's 'no TPU here', tfds's 'no OpenCV' (PIL decodes) and TensorFlow's C++ notices are
  not failures: hidden at the default verbosity, shown at --verbosity=1; a real warning of
  the same loggers still shows."""
  import logging as std_logging
  import subprocess
  import sys

  from absl import logging as absl_logging

  from trainer import console
  env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
  # TensorFlow 2.21 writes its notices past TF_CPP_MIN_LOG_LEVEL; also after a look-up that
  # is not an import (tfds checks what is installed with importlib.util.find_spec).
  for script in ("import trainer, tensorflow",
                 "import importlib.util, trainer; importlib.util.find_spec('tensorflow'); "
                 "import tensorflow as tf; tf.constant(1.0) + 1"):
    shown = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                           text=True, check=True, cwd=ROOT)
    assert "oneDNN" not in shown.stderr and "rebuild TensorFlow" not in shown.stderr, (
        script, shown.stderr)
  seen = []

  class Keep(std_logging.Handler):
    def emit(self, record):
      seen.append(record.getMessage())

  handler = Keep()
  std_logging.getLogger().addHandler(handler)
  saved = absl_logging.get_verbosity()
  try:
    std_logging.getLogger("jax._src.xla_bridge").setLevel(std_logging.INFO)
    std_logging.getLogger("jax._src.xla_bridge").info(
        "Unable to initialize backend 'tpu': INTERNAL: Failed to open libtpu.so")
    absl_logging.warning("OpenCV is not installed. We recommend using OpenCV")
    absl_logging.warning("a real warning")
    assert seen == ["a real warning"]
    absl_logging.set_verbosity(absl_logging.DEBUG)
    absl_logging.warning("OpenCV is not installed. We recommend using OpenCV")
    assert seen[-1].startswith("OpenCV is not installed")
  finally:
    absl_logging.set_verbosity(saved)
    std_logging.getLogger().removeHandler(handler)
  spec = ("OUT_OF_RANGE: Error reading \"rng/.zarray\": size 7 [tensorstore_spec='{\"a\": "
          "[1, 2]}'] and more")
  assert console.one_line(spec) == ("OUT_OF_RANGE: Error reading \"rng/.zarray\": size 7 [...] "
                                    "and more")
  assert len(console.one_line("x" * 5000)) == console.LINE_CHARS
