"""What a run leaves in its workdir and shows on the console: the config it ran with (every
override applied) as `config.json`, the hyperparameters in files rather than on the console,
zero bad-record counts once, no TFLOP/s or MFU on a CPU's log lines."""

import itertools
import json
import logging

import corpus_files as cf
import numpy as np
import pytest
from small_configs import tiny_lm_config

from trainer import writers
from trainer.data import corpus, lm
from trainer.language_model import LanguageModelTrainer, synthetic_token_batches


def _fit(config, workdir, caplog):
  from absl import logging as absl_logging
  batches = list(itertools.islice(synthetic_token_batches(0, 16, 16, 32), 2))
  writer = writers.create_writer(str(workdir), ("jsonl",))
  with caplog.at_level(logging.INFO):
    absl_logging.set_verbosity(absl_logging.INFO)
    LanguageModelTrainer(config).fit(batches, num_steps=2, writer=writer, workdir=str(workdir))
  writer.close()
  return [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]


def test_a_fit_with_a_workdir_writes_the_config_it_ran_with(tmp_path, caplog):
  config = tiny_lm_config(**{"strategy.name": "single_device", "log_every_steps": 1})
  config.model.update(family="llama", num_kv_heads=4, rope_theta=5e5)  # Overrides.
  lines = _fit(config, tmp_path, caplog)
  written = json.loads((tmp_path / "config.json").read_text())
  assert written == json.loads(config.to_json())
  assert written["model"]["num_kv_heads"] == 4 and written["model"]["rope_theta"] == 5e5
  # The hyperparameters are in the file, not on the console; the console says where.
  assert not [line for line in lines if "Hyperparameters" in line]
  assert f"The run's config: {tmp_path / 'config.json'}" in lines
  # The first news of the run comes once its step has compiled, not at the first log step.
  compiled = [line for line in lines if line.startswith("Train step compiled: step 1 of 2")]
  assert len(compiled) == 1
  # A CPU has no data-sheet peak: its log lines carry no TFLOP/s and no MFU.
  steps = [line for line in lines if line.startswith(("step ", "[1]", "[2]"))]
  assert steps and not [line for line in steps if "mfu" in line or "tflops" in line]
  record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
  assert "train/loss" in record or "loss" in record
  assert not {"mfu", "tflops_per_device"} & set(record)


def test_a_fit_without_a_workdir_writes_no_config(tmp_path, caplog, monkeypatch):
  monkeypatch.chdir(tmp_path)
  config = tiny_lm_config(**{"strategy.name": "single_device"})
  batches = list(itertools.islice(synthetic_token_batches(0, 16, 16, 32), 1))
  LanguageModelTrainer(config).fit(batches, num_steps=1)
  assert not list(tmp_path.iterdir())


class _Rows:
  """A writer that keeps what is written, by step."""

  def __init__(self):
    self.rows = {}

  def write_scalars(self, step, scalars):
    self.rows.setdefault(step, {}).update(scalars)


class _View:
  def __init__(self, step, data_state, last=False):
    self.step, self.data_state, self.is_last = step, data_state, last


@pytest.mark.parametrize("bad", [False, True])
def test_bad_record_counts_are_written_once_and_again_when_they_change(tmp_path, bad):
  root = cf.write_tokenizer(tmp_path)
  lines = ['{"text": 3}'] if bad else []
  cf.write_jsonl(tmp_path / "c.jsonl", [(d, 5) for d in range(30)], lines=lines)
  source = corpus.resolve(str(tmp_path / "c.jsonl"), field="text", weight=1.0, where="s")
  c = lm.Corpus([source], corpus.Tokenizer(str(root)), length=8, batch_size=2, lanes=1,
                bad_records="skip")
  stream, writer = c(), _Rows()
  action = lm.CorpusMetrics(writer, every_steps=1)
  for step in range(1, 40):
    next(stream)
    action.run(_View(step, stream.get_state()))
  first = min(writer.rows)
  assert set(writer.rows[first]) == {f"data/skipped_{k}" for k in corpus.BAD_KINDS}
  later = {s: row for s, row in writer.rows.items() if s != first}
  if not bad:
    assert first == 1 and not later  # The zeros once.
  else:  # The malformed count, when it grows past 0 (the corpus comes round again).
    assert later and all(set(row) == {"data/skipped_missing_field"} for row in later.values())
    counts = [row["data/skipped_missing_field"] for _, row in sorted(later.items())]
    assert counts == sorted(counts) and len(set(counts)) == len(counts) and np.all(
        np.asarray(counts) > 0)


def test_the_first_command_trains_one_epoch_as_the_docs_say():
  """The README's first command is the flagship's default config: one pass over MNIST's
  60,000 training images, the step count and time the getting-started page states."""
  import pathlib
  import re

  from configs import mnist_ensemble
  from trainer import data
  root = pathlib.Path(__file__).resolve().parents[1]
  steps = data.num_train_steps(mnist_ensemble.get_config(), 60_000)
  assert steps == 60_000 // 128
  page = (root / "docs" / "getting_started.md").read_text()
  assert f"one epoch ({steps} steps of 128 images)" in " ".join(page.split())
  readme = " ".join((root / "README.md").read_text().split())
  assert re.search(r"about [\d.]+ minutes on a 2-core CPU", readme)


def test_a_config_written_before_a_field_existed_reads_it_at_its_default(tmp_path):
  """`trainer.generate` (and the harness) read a run's config.json over today's defaults:
  an older run's file, without the fields added since, still builds its trainer."""
  from configs import lm as lm_config
  from trainer.generate import run_config
  old = json.loads(lm_config.get_config().to_json())
  del old["data"]["text_fields"], old["data"]["eval_text_fields"]
  old["model"] = {"family": "gpt2", "vocab_size": 64, "num_layers": 2, "embed_dim": 32,
                  "num_heads": 4, "mlp_dim": 64, "max_len": 16}  # As an HF import writes it.
  old["custom"] = {"kept": 1}  # A section of the run's own.
  (tmp_path / "config.json").write_text(json.dumps(old))
  config = run_config(str(tmp_path), None, None)
  assert tuple(config.data.text_fields) == () and tuple(config.data.eval_text_fields) == ()
  assert config.custom.kept == 1
  # The model is the file's alone: what it leaves out is its family's default.
  assert config.model.to_dict() == old["model"]
