"""The writers: metrics.jsonl (one record per split and write, on disk as soon as it is
written), and Weights & Biases offline."""

import json

import pytest

from trainer import writers
from trainer.writers import JsonlWriter


def test_each_write_is_on_disk_before_close(tmp_path):
  path = tmp_path / "metrics.jsonl"
  writer = JsonlWriter(str(path))
  writer.write_scalars(10, {"train/loss": 0.5, "train/accuracy": 0.75})
  assert json.loads(path.read_text()) == {"step": 10, "split": "train", "loss": 0.5,
                                          "accuracy": 0.75}
  writer.write_scalars(20, {"eval/nll": 0.25, "eval/ece": 0.125, "lr": 0.1})
  records = [json.loads(line) for line in path.read_text().splitlines()]
  assert records[1:] == [{"step": 20, "split": "eval", "nll": 0.25, "ece": 0.125},
                         {"step": 20, "split": None, "lr": 0.1}]
  writer.close()


def test_a_key_splits_at_its_first_part_and_a_members_label():
  assert writers.split_of("train/loss") == ("train", "loss")
  assert writers.split_of("train/rewards/chosen") == ("train", "rewards/chosen")
  assert writers.split_of("eval/lr=0.1,seed=2/rewards/chosen") == ("eval/lr=0.1,seed=2",
                                                                    "rewards/chosen")
  assert writers.split_of("lr") == (None, "lr")


def test_weights_and_biases_logs_offline_and_a_restart_resumes_the_same_run(tmp_path,
                                                                            monkeypatch):
  """`config.writers` with 'wandb', in W&B's offline mode (no network): the scalars and the
  config reach the run, and a second writer in the same workdir (a restarted run) resumes
  the run id kept there."""
  pytest.importorskip("wandb")  # The [test] extra installs it: CI runs this.
  from configs import base
  monkeypatch.setenv("WANDB_SILENT", "true")
  config = base.get_config()
  config.writers = ("jsonl", "wandb")
  config.wandb.mode = "offline"
  ids = []
  for attempt, step in enumerate((2, 4)):
    writer = writers.create_writer(str(tmp_path), config.writers, config)
    writer.write_hparams({"learning_rate": 0.1, "attempt": attempt})
    writer.write_scalars(step, {"train/loss": 1.5 / step})
    writer.write_texts(step, {"completions": "| 3+4= | 7 |"})
    wandb_writer = writer._writers[-1]
    ids.append(wandb_writer.run.id)
    writer.close()
  assert ids[0] == ids[1] == (tmp_path / writers.WANDB_ID_FILE).read_text()
  # W&B adds "-1" to the directory of a second attempt that starts in the same second.
  runs = sorted((tmp_path / "wandb").glob(f"offline-run-*-{ids[0]}*"))
  assert len(runs) == 2, list((tmp_path / "wandb").iterdir())
  logged = b"".join(p.read_bytes() for run in runs for p in run.glob("*.wandb"))
  assert b"train/loss" in logged and b"learning_rate" in logged and b"completions" in logged
  assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text()
          .splitlines()] == [2, 4]


def test_unknown_writers_are_refused_naming_the_accepted_ones(tmp_path):
  with pytest.raises(ValueError, match=r"config.writers=\('jsonl', 'mlflow'\) names "
                                       r"\['mlflow'\]; the writers are \('tensorboard', "
                                       r"'jsonl', 'wandb'\)"):
    writers.create_writer(str(tmp_path), ("jsonl", "mlflow"))
  assert not list(tmp_path.iterdir())


def test_tensorboard_events_are_written_without_importing_tensorflow(tmp_path):
  """`create_writer`'s TensorBoard file, in a fresh interpreter that never imports TensorFlow
  (clu's writers import it: seconds before a first step); TensorFlow's own reader then reads
  the scalars and the hyperparameters' summary back."""
  import subprocess
  import sys
  script = (
      "import sys\n"
      "from trainer import writers\n"
      f"w = writers.create_writer({str(tmp_path)!r}, ('tensorboard',))\n"
      "w.write_hparams({'learning_rate': 0.1, 'model': {'width': 8}})\n"
      "w.write_scalars(3, {'train/loss': 0.5, 'eval/accuracy': 1})\n"
      "w.write_texts(3, {'harness/generations': 'a -> b'})\n"
      "w.close()\n"
      "assert 'tensorflow' not in sys.modules, 'tensorflow imported'\n")
  subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
  import tensorflow as tf
  (events,) = tmp_path.glob("events.out.tfevents.*")
  seen = {(e.step, v.tag): v for e in tf.compat.v1.train.summary_iterator(str(events))
          for v in e.summary.value}
  assert seen[(3, "train/loss")].simple_value == 0.5
  assert seen[(3, "eval/accuracy")].simple_value == 1.0
  assert (0, "_hparams_/session_start_info") in seen
  assert b"learning_rate" in seen[(0, "_hparams_/session_start_info")].metadata.plugin_data.content


def test_texts_reach_tensorboard_and_a_file_a_script_reads(tmp_path):
  """Every writer of `create_writer` takes texts: TensorBoard's Text tab (read back with
  TensorBoard's own `EventAccumulator`), `texts.jsonl` (one JSON object per text) and the
  console."""
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
  writer = writers.create_writer(str(tmp_path), ("tensorboard", "jsonl"))
  table = "| prompt | completion |\n|---|---|\n| 3+4= | 7 |"
  writer.write_texts(5, {"completions": table, "harness/generations": "'x' -> 'ünï'"})
  writer.write_texts(9, {"completions": "| later |"})
  writer.close()
  (events,) = tmp_path.glob("events.out.tfevents.*")
  accumulator = EventAccumulator(str(events), size_guidance={"tensors": 0})
  accumulator.Reload()
  assert {"completions", "harness/generations"} <= set(accumulator.Tags()["tensors"])
  written = {(e.step, e.tensor_proto.string_val[0].decode())
             for e in accumulator.Tensors("completions")}
  assert written == {(5, table), (9, "| later |")}
  records = [json.loads(line) for line in (tmp_path / writers.TEXTS_NAME).read_text()
             .splitlines()]
  assert records == [{"step": 5, "name": "completions", "text": table},
                     {"step": 5, "name": "harness/generations", "text": "'x' -> 'ünï'"},
                     {"step": 9, "name": "completions", "text": "| later |"}]
