"""Metric writers: the console, TensorBoard event files, `metrics.jsonl` and `texts.jsonl`
files, and Weights & Biases (optional: `pip install ".[wandb]"`), chosen by
`config.writers`.

Each is a clu `MetricWriter` by its methods (`write_scalars`, `write_texts`,
`write_hparams`, ..., `flush`, `close`), so a clu writer can be passed wherever these are.
Scalars, texts (generations, RL's sample completions, the harness's samples) and
hyperparameters are written; images, videos, audio and histograms are dropped. They do not
import `clu.metric_writers`: that package imports TensorFlow (and Keras) for its
TensorBoard writer, seconds before a first step in a run that reads no TFDS data.
TensorBoard's event files are written with the `tensorboard` package's own record writer
and its plugins' summary protos (scalars, text, hparams), which TensorBoard reads as it
reads TensorFlow's.
"""

from __future__ import annotations

import html
import json
import os
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from absl import logging

JSONL_NAME = "metrics.jsonl"
#: Beside it, the texts (`JsonlWriter.write_texts`).
TEXTS_NAME = "texts.jsonl"


class ScalarWriter:
  """The writers' base: the kinds a subclass does not write are dropped.

  The methods are clu's `MetricWriter` interface.
  """

  def write_scalars(self, step: int, scalars: Mapping[str, Any]):
    raise NotImplementedError

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

  def flush(self):
    pass

  def close(self):
    pass


class LoggingWriter(ScalarWriter):
  """The console: one INFO line per write, `[step] name=value, ...`, as clu's LoggingWriter
  writes it; the `train/` scalars of a log step are left out (the loop's own line says
  the loss, the rate and the ETA; the files hold every train scalar, and the run's end
  logs its time breakdown), and shown with `--verbosity=1`."""

  def write_scalars(self, step: int, scalars: Mapping[str, Any]):
    shown = {k: v for k, v in scalars.items() if not k.startswith("train/")}
    if shown:
      logging.info("[%d] %s", step, _line(shown))
    if len(shown) < len(scalars):
      logging.debug("[%d] %s", step, _line(scalars))

  def write_texts(self, step: int, texts: Mapping[str, str]):
    for name, text in sorted(texts.items()):
      logging.info("[%d] %s:\n%s", step, name, text)

  def write_hparams(self, hparams: Mapping[str, Any]):
    # Thousands of characters: a run's config goes to its files (config.json, TensorBoard's
    # hparams), and to the console only with --verbosity=1.
    logging.debug("[Hyperparameters] %s", hparams)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
  """A Markdown table for `write_texts` (TensorBoard's Text tab renders it): a float to 4
  places (NaN as a dash), `|` escaped and line breaks as `<br>` in each cell."""
  def cell(value: Any) -> str:
    if isinstance(value, float):
      value = "—" if value != value else f"{value:.4f}"
    return str(value).replace("|", "\\|").replace("\n", "<br>")

  lines = ["| " + " | ".join(map(cell, header)) + " |", "|" + "---|" * len(header)]
  return "\n".join(lines + ["| " + " | ".join(map(cell, row)) + " |" for row in rows])


def _line(scalars: Mapping[str, Any]) -> str:
  return ", ".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}"
                   for k, v in sorted(scalars.items()))


class TensorBoardWriter(ScalarWriter):
  """A TensorBoard event file in `logdir`: scalars, texts (its Text tab) and
  hyperparameters (its HParams tab).

  Records are written with tensorboard's `RecordWriter` to a plain file, flushed at each
  write: tensorboard's `EventFileWriter` would reach `tf.io.gfile`, which imports
  TensorFlow wherever it is installed.
  """

  def __init__(self, logdir: str):
    import socket

    from tensorboard.summary.writer.record_writer import RecordWriter
    name = f"events.out.tfevents.{time.time():.6f}.{socket.gethostname()}.{os.getpid()}"
    self._file = open(os.path.join(logdir, name), "wb")  # noqa: SIM115 -- close().
    self._records = RecordWriter(self._file)
    self._add(event_kwargs=dict(file_version="brain.Event:2"))

  def _add(self, summary=None, step: int = 0, event_kwargs=None) -> None:
    from tensorboard.compat.proto import event_pb2
    event = event_pb2.Event(step=int(step), wall_time=time.time(), **(event_kwargs or {}))
    if summary is not None:
      event.summary.CopyFrom(summary)
    self._records.write(event.SerializeToString())
    self._file.flush()

  def write_scalars(self, step: int, scalars: Mapping[str, Any]):
    from tensorboard.compat.proto import summary_pb2
    self._add(summary_pb2.Summary(value=[
        summary_pb2.Summary.Value(tag=k, simple_value=float(v)) for k, v in scalars.items()]),
        step)

  def write_texts(self, step: int, texts: Mapping[str, str]):
    from tensorboard.compat.proto import summary_pb2
    from tensorboard.plugins.text import summary_v2
    summary = summary_pb2.Summary()
    for name, text in texts.items():
      summary.MergeFrom(summary_v2.text_pb(name, str(text)))
    self._add(summary, step)

  def write_hparams(self, hparams: Mapping[str, Any]):
    from tensorboard.plugins.hparams import summary_v2
    kept = {k: v for k, v in _flat(hparams).items() if isinstance(v, bool | int | float | str)}
    self._add(summary_v2.hparams_pb(kept))

  def flush(self):
    self._file.flush()

  def close(self):
    self._file.close()


def _flat(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  """A nested dict's leaves under `a.b` names; a sequence as its string."""
  out = {}
  for k, v in tree.items():
    if isinstance(v, Mapping):
      out.update(_flat(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = str(v) if isinstance(v, Sequence) and not isinstance(v, str) else v
  return out


class MultiWriter(ScalarWriter):
  """Every write to each of `writers`, in order."""

  def __init__(self, writers: Sequence[Any]):
    self._writers = list(writers)

  def write_scalars(self, step, scalars):
    for w in self._writers:
      w.write_scalars(step, scalars)

  def write_texts(self, step, texts):
    for w in self._writers:
      w.write_texts(step, texts)

  def write_hparams(self, hparams):
    for w in self._writers:
      w.write_hparams(hparams)

  def flush(self):
    for w in self._writers:
      w.flush()

  def close(self):
    for w in self._writers:
      w.close()


def split_of(key: str) -> tuple[str | None, str]:
  """`(split, name)` of a scalar's key: its first part is the split (`train`, `eval`,
  `harness`), and a sweep member's label after it (`eval/learning_rate=0.1/accuracy`) is
  part of the split; the rest is the name, slashes and all (TRL's `rewards/chosen`). A key
  without a slash has no split."""
  parts = key.split("/")
  if len(parts) == 1:
    return None, key
  n = 2 if len(parts) > 2 and "=" in parts[1] else 1
  return "/".join(parts[:n]), "/".join(parts[n:])


class JsonlWriter(ScalarWriter):
  """Appends one JSON object per `write_scalars` call and split: `step`, `split`, and the
  scalars (`split_of`: `train/rewards/chosen` is split `train`, name `rewards/chosen`);
  and to `texts_path` (`texts.jsonl` beside it by default), one per text: `step`, `name`,
  `text`. Keys without a prefix are written under `split: null`.
  """

  def __init__(self, path: str, texts_path: str | None = None):
    # Line-buffered: each record is on disk as soon as it is written, so a long
    # run can be followed with `tail -f` and a crash loses nothing written.
    self._file = open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115 -- close().
    self._texts_path = texts_path or os.path.join(os.path.dirname(path), TEXTS_NAME)
    self._texts = None  # Opened at the first text.

  def write_texts(self, step: int, texts: Mapping[str, str]):
    if self._texts is None:
      self._texts = open(self._texts_path, "a", encoding="utf-8",  # noqa: SIM115 -- close().
                         buffering=1)
    for name, text in texts.items():
      self._texts.write(json.dumps({"step": int(step), "name": name, "text": str(text)},
                                   ensure_ascii=False) + "\n")

  def write_scalars(self, step: int, scalars: Mapping[str, Any]):
    by_split: dict[str | None, dict[str, float]] = {}
    for key, value in scalars.items():
      split, name = split_of(key)
      by_split.setdefault(split, {})[name] = float(value)
    for split, values in by_split.items():
      self._file.write(json.dumps({"step": int(step), "split": split, **values}) + "\n")

  def flush(self):
    self._file.flush()

  def close(self):
    self._file.close()
    if self._texts is not None:
      self._texts.close()


#: What `config.writers` may name.
WRITERS = ("tensorboard", "jsonl", "wandb")
#: The file in a workdir that keeps the W&B run id, so a restarted run logs to the same run.
WANDB_ID_FILE = "wandb_run_id"


class WandbWriter(ScalarWriter):
  """Logs scalars and hyperparameters to a Weights & Biases run.

  The run id is kept in `<workdir>/wandb_run_id`: a run that restarts (the
  launcher's `--max_restarts`, a requeued job) resumes the same W&B run
  (`resume="allow"`). Steps a restart redoes are logged again; W&B keeps the
  first value of a step it has seen.
  """

  def __init__(self, workdir: str, *, project: str, entity: str = "", mode: str = "",
               name: str = ""):
    import wandb
    id_file = os.path.join(workdir, WANDB_ID_FILE)
    if os.path.exists(id_file):
      with open(id_file) as f:
        run_id = f.read().strip()
    else:
      run_id = uuid.uuid4().hex[:12]
      with open(id_file, "w") as f:
        f.write(run_id)
    self.run = wandb.init(project=project, entity=entity or None, mode=mode or None,
                          name=name or os.path.basename(os.path.abspath(workdir)),
                          id=run_id, resume="allow", dir=workdir, reinit="finish_previous")

  def write_scalars(self, step: int, scalars: Mapping[str, Any]):
    self.run.log({k: float(v) for k, v in scalars.items()}, step=int(step))

  def write_texts(self, step: int, texts: Mapping[str, str]):
    import wandb
    self.run.log({k: wandb.Html(f"<pre>{html.escape(str(v))}</pre>") for k, v in texts.items()},
                 step=int(step))

  def write_hparams(self, hparams: Mapping[str, Any]):
    self.run.config.update(dict(hparams), allow_val_change=True)

  def flush(self):
    pass

  def close(self):
    self.run.finish()


def check_writers(kinds) -> tuple[str, ...]:
  """`config.writers`, checked (before any compute).

  Raises:
    ValueError: an unknown writer, or 'wandb' without the wandb package.
  """
  kinds = tuple(kinds)
  unknown = [k for k in kinds if k not in WRITERS]
  if unknown:
    raise ValueError(f"config.writers={kinds!r} names {unknown}; the writers are {WRITERS}.")
  if "wandb" in kinds:
    try:
      import wandb  # noqa: F401
    except ImportError as e:
      raise ValueError(f"config.writers={kinds!r} asks for W&B, but the wandb package is not "
                       f"installed: pip install -e '.[wandb]'.") from e
  return kinds


def create_writer(workdir: str, kinds=("tensorboard", "jsonl"), config: Any = None) -> MultiWriter:
  """The console plus the `kinds` (`config.writers`) in `workdir`: TensorBoard event files,
  `metrics.jsonl`, a W&B run (`config.wandb.project`, `.entity`, `.mode`).

  Only process 0 writes files and W&B; other processes log to the console.

  Raises:
    ValueError: `check_writers` refuses `kinds`, or W&B is asked for without a `config`.
  """
  kinds = check_writers(kinds)
  if "wandb" in kinds and config is None:
    raise ValueError("create_writer: the 'wandb' writer reads config.wandb; pass config=.")
  if jax.process_index() > 0:
    return MultiWriter([LoggingWriter()])
  os.makedirs(workdir, exist_ok=True)
  writers: list[Any] = [LoggingWriter()]
  if "tensorboard" in kinds:
    writers.append(TensorBoardWriter(workdir))
  if "jsonl" in kinds:
    writers.append(JsonlWriter(os.path.join(workdir, JSONL_NAME)))
  if "wandb" in kinds:
    writers.append(WandbWriter(workdir, project=config.wandb.project,
                               entity=config.wandb.entity, mode=config.wandb.mode))
  return MultiWriter(writers)
