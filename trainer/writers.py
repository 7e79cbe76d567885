"""Metric writers: TensorBoard and console through clu, plus a `metrics.jsonl` file."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import jax
from clu import metric_writers

JSONL_NAME = "metrics.jsonl"


class JsonlWriter(metric_writers.MetricWriter):
  """Appends one JSON object per `write_scalars` call: `step`, `split`, and the scalars.

  Keys of the form `split/name` (as the Trainer writes them) give the split;
  keys without a prefix are written under `split: null`.
  """

  def __init__(self, path: str):
    # Line-buffered: each record is on disk as soon as it is written, so a long
    # run can be followed with `tail -f` and a crash loses nothing written.
    self._file = open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115 -- close().

  def write_scalars(self, step: int, scalars: Mapping[str, Any]):
    by_split: dict[str | None, dict[str, float]] = {}
    for key, value in scalars.items():
      split, _, name = key.rpartition("/")
      by_split.setdefault(split or None, {})[name] = float(value)
    for split, values in by_split.items():
      self._file.write(json.dumps({"step": int(step), "split": split, **values}) + "\n")

  def flush(self):
    self._file.flush()

  def close(self):
    self._file.close()

  # Only scalars go to the JSONL file.
  def write_summaries(self, step, values, metadata=None):
    pass

  def write_images(self, step, images):
    pass

  def write_videos(self, step, videos):
    pass

  def write_audios(self, step, audios, *, sample_rate):
    pass

  def write_texts(self, step, texts):
    pass

  def write_histograms(self, step, arrays, num_buckets=None):
    pass

  def write_hparams(self, hparams):
    pass


def create_writer(workdir: str) -> metric_writers.MetricWriter:
  """TensorBoard event files and `metrics.jsonl` in `workdir`, and the console.

  Only process 0 writes files; other processes log to the console.
  """
  if jax.process_index() > 0:
    return metric_writers.create_default_writer(just_logging=True)
  os.makedirs(workdir, exist_ok=True)
  return metric_writers.MultiWriter([
      metric_writers.create_default_writer(workdir, asynchronous=False),
      JsonlWriter(os.path.join(workdir, JSONL_NAME)),
  ])
