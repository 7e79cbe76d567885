"""metrics.jsonl: one record per split and write, on disk as soon as it is written."""

import json

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
