"""The MNIST ensemble example through its real entry point.

The tests run the same `train_and_evaluate` in-process on
`tfds.testing.mock_data` (`conftest.mock_tfds`). The README's first command on
the real MNIST files is checked in `test_doc_commands_mnist.py`, beside the
fixture that runs it.
"""

import importlib
import json
import pathlib
import subprocess
import sys

import numpy as np
import process_cache
import pytest
from conftest import mock_tfds

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "mnist_ensemble.py"

ENSEMBLE_KEYS = {"ensemble_accuracy", "member_accuracy", "ensemble_nll", "member_nll",
                 "ensemble_ece", "member_ece", "disagreement"}
SINGLE_KEYS = {"accuracy", "nll", "ece"}


def _read_jsonl(path):
  return [json.loads(line) for line in pathlib.Path(path).read_text().splitlines()]


def _example_env():
  # The entry point must make its devices itself.
  return process_cache.launched_env(PYTHONPATH=str(ROOT))


@pytest.fixture(scope="module")
def example():
  sys.path.insert(0, str(EXAMPLE.parent))
  try:
    return importlib.import_module("mnist_ensemble")
  finally:
    sys.path.remove(str(EXAMPLE.parent))


@pytest.mark.parametrize("config_name,strategy,keys", [
    ("mnist_ensemble", None, ENSEMBLE_KEYS),
    ("mnist_data_parallel", None, SINGLE_KEYS),
    ("mnist_sharded", None, SINGLE_KEYS),
    ("mnist_ensemble", "single_device", SINGLE_KEYS),
    ("mnist_ensemble", "sharded_data_parallel", SINGLE_KEYS),
    ("mnist_ensemble", "sharded_ensemble@memory", ENSEMBLE_KEYS),
    ("mnist_on_device", None, ENSEMBLE_KEYS),  # Device data, 16 steps a call: calls of 3.
    ("mnist_ensemble", "single_device@device", SINGLE_KEYS),
])
def test_each_config_trains_on_mock_data(example, tmp_path, config_name, strategy, keys):
  """`strategy@memory`: the in-memory pipeline instead of the config's (Grain, or device
  data for `mnist_on_device`)."""
  config = importlib.import_module(f"configs.{config_name}").get_config()
  strategy, _, pipeline = (strategy or "").partition("@")
  if strategy:
    config.strategy.name = strategy  # The only change needed to switch strategy.
  config.data.pipeline = pipeline or config.data.pipeline
  assert config.data.pipeline == (pipeline or {"mnist_on_device": "device"}.get(config_name,
                                                                                "grain"))
  config.batch_size = 16
  config.eval_batch_size = 16
  config.num_train_steps = 6
  config.log_every_steps = 3
  config.eval_every_steps = 3
  config.data.manual_dir = ""
  with mock_tfds(40):
    results = example.train_and_evaluate(config, str(tmp_path))
  assert set(results) == keys
  records = _read_jsonl(tmp_path / "metrics.jsonl")
  assert [(r["step"], r["split"]) for r in records] == [
      (3, "train"), (3, "eval"), (6, "train"), (6, "eval")]
  assert set(records[-1]) == keys | {"step", "split"}
  assert records[-1] == {"step": 6, "split": "eval", **results}


def test_unknown_config_field_fails_before_reading_data(tmp_path):
  result = subprocess.run(
      [sys.executable, str(EXAMPLE), f"--workdir={tmp_path / 'workdir'}",
       "--config.ensemble_sise=4", f"--config.data.data_dir={tmp_path / 'tfds'}"],
      cwd=tmp_path, env=_example_env(), capture_output=True, text=True, timeout=300)
  assert result.returncode != 0
  assert "ensemble_sise" in result.stderr
  assert not (tmp_path / "tfds").exists()
  assert not (tmp_path / "workdir").exists()


def test_cpu_devices_follow_the_ensemble_size_unless_set():
  config = importlib.import_module("configs.mnist_ensemble").get_config()
  assert config.num_cpu_devices == config.ensemble_size == 8
  config.ensemble_size = 16
  assert config.num_cpu_devices == 16
  config.num_cpu_devices = 4
  assert (config.ensemble_size, config.num_cpu_devices) == (16, 4)


def test_rerun_in_the_same_workdir_resumes_from_the_latest_checkpoint(example, tmp_path):
  config = importlib.import_module("configs.mnist_ensemble").get_config()
  config.batch_size = 16
  config.eval_batch_size = 16
  config.num_train_steps = 6
  config.log_every_steps = 3
  config.checkpoint.every_steps = 3
  config.data.manual_dir = ""
  with mock_tfds(40):
    first = example.train_and_evaluate(config, str(tmp_path))
    steps = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert steps == ["3", "6"]
    again = example.train_and_evaluate(config, str(tmp_path))  # Nothing left to train.
    assert again == first
    config.num_train_steps = 9
    example.train_and_evaluate(config, str(tmp_path))
  records = _read_jsonl(tmp_path / "metrics.jsonl")
  train_steps = [r["step"] for r in records if r["split"] == "train"]
  assert train_steps == [3, 6, 9]  # The third run started at step 6.
  assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir()) == [3, 6, 9]


def test_the_finetuning_configs_pretrain_then_finetune_with_frozen_convolutions(example,
                                                                                  tmp_path):
  """configs/mnist_finetune.py on mock data: the fine-tune run starts from the pretrain
  run's checkpoint, keeps its convolutions bitwise and trains a new head."""
  from configs import mnist_finetune
  from trainer.checkpoint import init_from

  def run(variant, **overrides):
    config = mnist_finetune.get_config(variant)
    config.update_from_flattened_dict({
        "batch_size": 8, "eval_batch_size": 8, "num_train_steps": 4, "log_every_steps": 2,
        "data.manual_dir": "", **overrides})
    with mock_tfds(80):
      results = example.train_and_evaluate(config, str(tmp_path / variant))
    assert set(results) == SINGLE_KEYS
    return init_from.open_source(str(tmp_path / variant))

  pretrained = run("pretrain")
  tuned = run("finetune", **{"init_from.path": str(tmp_path / "pretrain")})
  paths = sorted(pretrained.arrays["params"])
  before = pretrained.read({"params": paths})["params"]
  after = tuned.read({"params": paths})["params"]
  assert [p for p in paths if p.startswith("Conv_")] == [
      "Conv_0/bias", "Conv_0/kernel", "Conv_1/bias", "Conv_1/kernel"]
  for path in paths:
    if path.startswith("Conv_"):
      np.testing.assert_array_equal(after[path], before[path], err_msg=path)
    else:
      assert not np.array_equal(after[path], before[path]), path
  with pytest.raises(ValueError, match=r"configs/mnist_finetune.py:tune is not a variant"):
    mnist_finetune.get_config("tune")
