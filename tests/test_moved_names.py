"""Names that moved when the Trainer went back to its hooks (issue 14) and when `trainer/`
became packages (issue 9): an old path a user may have used keeps working, or fails with an
error that names the new one."""

import importlib
import os
import pathlib
import subprocess
import sys

import pytest
from conftest import CNNTrainer, cnn_config

import trainer
from trainer import MOVED_MODULES
from trainer.trainer import _MOVED as MOVED

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _forget(old: str) -> None:
  """As in a new process: the old name not imported yet."""
  sys.modules.pop(old, None)
  vars(trainer).pop(old.rsplit(".", 1)[1], None)


@pytest.mark.parametrize("old,new", sorted(MOVED_MODULES.items()))
def test_a_moved_module_imports_as_the_new_one_with_a_warning(old, new):
  _forget(old)
  with pytest.warns(FutureWarning, match=f"{old} moved to {new}"):
    module = importlib.import_module(old)
  assert module is importlib.import_module(new)
  assert module.__spec__.name == new  # The module keeps its own spec.


def test_from_trainer_import_an_old_module_works():
  _forget("trainer.optim")
  with pytest.warns(FutureWarning):
    from trainer import optim
  from trainer.step import optim as new
  assert optim.create_optimizer is new.create_optimizer


def test_a_split_module_names_where_its_parts_went():
  with pytest.raises(ImportError, match=r"trainer.actions was split into trainer.loop.actions "
                                        r"\(Action.*trainer.loop.builtin.*trainer.loop.driver"):
    importlib.import_module("trainer.actions")


def test_a_removed_export_names_its_replacement():
  with pytest.raises(AttributeError, match=r"trainer.Loop is gone: the loop is "
                                           r"trainer.loop.driver.run"):
    trainer.Loop  # noqa: B018


def test_python_m_trainer_launch_runs_the_launcher():
  env = {**os.environ, "PYTHONWARNINGS": "default"}
  result = subprocess.run([sys.executable, "-m", "trainer.launch", "--help"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "--num_processes" in result.stdout and "--max_restarts" in result.stdout
  assert "trainer.launch moved to trainer.distributed.launch" in result.stderr


@pytest.fixture(scope="module")
def a_trainer():
  return CNNTrainer(cnn_config())


@pytest.mark.parametrize("name", sorted(MOVED))
def test_a_trainer_attribute_that_moved_names_where(a_trainer, name):
  with pytest.raises(AttributeError, match=f"Trainer.{name} moved out of the Trainer: use "):
    getattr(a_trainer, name)


def test_an_unknown_trainer_attribute_is_a_plain_attribute_error(a_trainer):
  with pytest.raises(AttributeError, match=r"'CNNTrainer' object has no attribute 'nope'$"):
    a_trainer.nope  # noqa: B018
  assert not hasattr(a_trainer, "step_flops")


def test_the_sweep_package_keeps_the_modules_names():
  from trainer import sweep
  assert {"Sweep", "SWEPT", "swept_optimizer", "place_hyperparameters", "plot",
          "format_table", "summary_rows", "single_model_opt_state"} <= set(dir(sweep))
  from trainer.loop.builtin import SweepReport
  assert SweepReport is sweep.SweepReport
  with pytest.raises(AttributeError, match=r"check_sweep_fits is gone: use "
                                           r"trainer.sweep.fit_strategy"):
    sweep.check_sweep_fits  # noqa: B018


@pytest.mark.parametrize("old,new,names", [
    ("trainer.data.corpus", "trainer.data.records",
     ("CorpusError", "format_of", "FORMATS", "ENDINGS", "TFDS_PREFIX", "tfds_source",
      "check_tfds", "has_text_column", "BadRecord")),
    ("trainer.step.model_variables", "trainer.step.rng_streams",
     ("RngStreams", "MissingRngStreamError")),
])
def test_names_of_a_split_module_still_import_from_it(old, new, names):
  """Files split where they grew past 500 lines: the names that moved are the same objects
  under their old module."""
  old_module, new_module = importlib.import_module(old), importlib.import_module(new)
  assert [n for n in names if getattr(old_module, n, None) is not getattr(new_module, n)] == []
