"""Image-classification data through tensorflow-datasets.

TFDS prepares the dataset (offline from the original files when
`config.data.manual_dir` is set), and the splits are read once into host
memory. The training order is a pure function of (seed, step): epoch e is the
permutation `default_rng((seed, e))`, so a run resumed at any step sees the
same batches as an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import gzip
import os
import socket
import struct
import urllib.parse
import zlib
from collections.abc import Callable, Iterator

import jax
import ml_collections
import numpy as np

from trainer.data.device import DeviceData, as_float_images

#: Where `data.manual_dir` comes from when the config leaves it empty.
MANUAL_DIR_ENV = "TFDS_MANUAL_DIR"

#: The original IDX files of MNIST (what TFDS's mnist builder downloads), with
#: their magic number and the shape each one must hold.
MNIST_FILES = {
    "train-images-idx3-ubyte.gz": (2051, (60000, 28, 28)),
    "train-labels-idx1-ubyte.gz": (2049, (60000,)),
    "t10k-images-idx3-ubyte.gz": (2051, (10000, 28, 28)),
    "t10k-labels-idx1-ubyte.gz": (2049, (10000,)),
}
#: The files a dataset's manual directory must hold, by dataset name (checked before TFDS).
MANUAL_FILES = {"mnist": MNIST_FILES}


def _tfds():
  """tensorflow-datasets, imported where TFDS data is read: a run that reads none (an LM
  on token files, a benchmark on random batches) never loads it."""
  import tensorflow_datasets as tfds
  return tfds


def check_idx_file(path: str, magic: int, shape: tuple[int, ...]) -> None:
  """Checks that a gzipped IDX file is complete and holds `shape` unsigned bytes.

  Raises:
    FileNotFoundError: the file is missing.
    ValueError: the file is not gzip, is truncated, or has the wrong header or size.
  """
  if not os.path.isfile(path):
    raise FileNotFoundError(f"MNIST file {path} is missing from config.data.manual_dir.")
  try:
    with gzip.open(path, "rb") as f:
      raw = f.read()
  except (OSError, EOFError, zlib.error) as e:
    raise ValueError(f"MNIST file {path} is corrupt: not a complete gzip file ({e}).") from e
  header = 4 + 4 * len(shape)
  if len(raw) < header:
    raise ValueError(f"MNIST file {path} is corrupt: {len(raw)} bytes is shorter than "
                     f"its IDX header.")
  got_magic, *dims = struct.unpack(f">{1 + len(shape)}I", raw[:header])
  expected_size = header + int(np.prod(shape))
  if got_magic != magic or tuple(dims) != shape or len(raw) != expected_size:
    raise ValueError(
        f"MNIST file {path} is corrupt: IDX magic {got_magic}, dims {tuple(dims)}, "
        f"{len(raw)} bytes; expected magic {magic}, dims {shape}, {expected_size} bytes.")


#: The file formats TFDS prepares in: tfrecord (read through tf.data) or array_record
#: (random access through `tfds.data_source`, which `trainer.data.pipeline` needs).
FILE_FORMATS = ("tfrecord", "array_record")


def prepare(name: str, data_dir: str | None, manual_dir: str | None,
            file_format: str | None = None):
  """Returns a TFDS builder whose data is prepared, offline if `manual_dir` is set.

  `file_format` None takes the dataset in the format it was prepared in
  (`load_split` reads both), and prepares a new one as array_record, the
  format every pipeline reads (Grain needs it), so the commands of several
  pipelines work in any order on one data directory.

  On a multi-process run process 0 prepares while the others wait, then they
  open what it wrote (`data_dir` must be shared, as a cluster's file system is).

  Raises:
    FileNotFoundError, ValueError: a file in `manual_dir` is missing or corrupt.
    RuntimeError: preparing without `manual_dir` failed (typically: no network).
  """
  if file_format is not None and file_format not in FILE_FORMATS:
    raise ValueError(f"file format {file_format!r} is not one of {FILE_FORMATS}.")
  if jax.process_count() == 1:
    return _prepare(name, data_dir, manual_dir, file_format)
  from jax.experimental import multihost_utils
  builder = (_prepare(name, data_dir, manual_dir, file_format) if jax.process_index() == 0
             else None)
  multihost_utils.sync_global_devices(f"tfds prepared {name}")
  return builder or _prepare(name, data_dir, manual_dir, file_format)


def _builder(name: str, data_dir: str | None, file_format: str | None):
  """A TFDS builder that prepares (or finds) `name` in `file_format` (None: as prepared,
  else array_record).

  Raises:
    ValueError: `data_dir` already holds the dataset in the other format.
  """
  if file_format is None:
    builder = _tfds().builder(name, data_dir=data_dir or None)
    if builder.is_prepared():
      return builder
    file_format = "array_record"
  try:
    return _tfds().builder(name, data_dir=data_dir or None, file_format=file_format)
  except ValueError as e:
    if "File format is already set" not in str(e):
      raise
    other = next(f for f in FILE_FORMATS if f != file_format)
    pipeline = "grain" if file_format == "array_record" else "memory"
    raise ValueError(
        f"config.data.pipeline={pipeline!r} reads {name!r} prepared as {file_format}, but "
        f"{data_dir or 'the default TFDS data_dir'} holds it as {other}. Set "
        f"config.data.data_dir (or TFDS_DATA_DIR) to another directory, where it is "
        f"prepared again, or use config.data.pipeline='memory' (which reads both).") from e


def check_reachable(url: str, *, timeout: float = 5.0) -> None:
  """Raises OSError at once if `url`'s server cannot be reached (no network, say).

  TFDS retries a failed download for minutes before it gives up; this asks once.
  """
  parts = urllib.parse.urlsplit(url)
  port = parts.port or (443 if parts.scheme == "https" else 80)
  with socket.create_connection((parts.hostname, port), timeout=timeout):
    pass


def _offline_error(name: str, data_dir: str | None, e: Exception) -> RuntimeError:
  files = ", ".join(MANUAL_FILES.get(name, {})) or "the dataset's original files"
  return RuntimeError(
      f"TFDS could not download and prepare {name!r} into "
      f"{data_dir or 'the default TFDS data_dir'} ({type(e).__name__}: {e}). Without "
      f"network access, put {files} in a directory and set config.data.manual_dir (or "
      f"the {MANUAL_DIR_ENV} environment variable) to it.")


def _prepare(name: str, data_dir: str | None, manual_dir: str | None,
             file_format: str | None):
  _tfds().disable_progress_bar()  # Dozens of bar lines would bury the run's own log.
  builder = _builder(name, data_dir, file_format)
  in_format = {"file_format": file_format} if file_format else {}
  if manual_dir:
    if not builder.is_prepared():  # Prepared data never reads them (each check reads 55 MB).
      for filename, (magic, shape) in MANUAL_FILES.get(name, {}).items():
        check_idx_file(os.path.join(manual_dir, filename), magic, shape)
    builder.download_and_prepare(
        download_config=_tfds().download.DownloadConfig(manual_dir=manual_dir), **in_format)
    return builder
  # Fail in seconds, not after minutes of TFDS's retries (tfds.testing.mock_data, which
  # replaces the download, needs no network).
  url = getattr(type(builder), "URL", None)
  downloads = type(builder).download_and_prepare.__module__.startswith("tensorflow_datasets.core")
  if url and downloads and not builder.is_prepared():
    default_manual = os.path.join(os.fspath(builder.data_dir_root), "downloads", "manual")
    if not os.path.isdir(default_manual):
      try:
        check_reachable(url)
      except OSError as e:
        raise _offline_error(name, data_dir, e) from e
  try:
    builder.download_and_prepare(**in_format)
  except Exception as e:  # Network errors surface as many types; the fix is the same.
    raise _offline_error(name, data_dir, e) from e
  return builder


@dataclasses.dataclass(frozen=True)
class Split:
  """One split in host memory: uint8 images [N, H, W, C] and int32 labels [N]."""

  images: np.ndarray
  labels: np.ndarray

  def __len__(self) -> int:
    return len(self.labels)

  def batch(self, indices: np.ndarray) -> dict[str, np.ndarray]:
    return {"image": self.images[indices].astype(np.float32) / 255.0,
            "label": self.labels[indices]}

  def with_classes(self, classes, field: str = "data.classes") -> Split:
    """The examples whose label is one of `classes` (labels unchanged).

    Raises:
      ValueError: a class that no example has, naming `field`.
    """
    classes = [int(c) for c in classes]
    present = set(np.unique(self.labels).tolist())
    missing = sorted(set(classes) - present)
    if missing:
      raise ValueError(f"config.{field}={tuple(classes)!r} names classes {missing} that no "
                       f"example has; the labels are {sorted(present)}.")
    keep = np.isin(self.labels, classes)
    return Split(images=self.images[keep], labels=self.labels[keep])

  def device_data(self, batch_size: int, seed: int) -> DeviceData:
    """The split for `config.data.pipeline = "device"`: placed on the devices, each step's
    batch (the same values `batch` gives) gathered inside the compiled call."""
    return DeviceData({"image": self.images, "label": self.labels}, batch_size=batch_size,
                      seed=seed, transform=as_float_images)


def load_split(builder, split: str, chunk: int = 10_000, field: str = "split") -> Split:
  """Reads a whole prepared split (or a TFDS slice of one, e.g. `train[:10%]`) into memory.

  Reads in chunks rather than with `batch_size=-1`, which aborts TensorFlow on
  datasets of unknown cardinality (such as `tfds.testing.mock_data`'s). A
  dataset prepared as array_record is read through its data source.

  Raises:
    ValueError: `split` names no split of the dataset, or is not a valid slice;
      the message names the config `field` it came from.
  """
  if str(builder.info.file_format) == str(_tfds().core.FileFormat.ARRAY_RECORD):
    source = data_source(builder, split, field)
    chunks = [_stack(source.__getitems__(list(range(i, min(i + chunk, len(source))))))
              for i in range(0, len(source), chunk)]
  else:
    try:
      chunks = list(_tfds().as_numpy(builder.as_dataset(split=split, batch_size=chunk)))
    except (ValueError, KeyError, AssertionError) as e:
      raise _split_error(builder, split, field, e) from e
  return Split(images=np.concatenate([c["image"] for c in chunks]).astype(np.uint8),
               labels=np.concatenate([c["label"] for c in chunks]).astype(np.int32))


def _stack(records: list[dict]) -> dict[str, np.ndarray]:
  return {k: np.stack([r[k] for r in records]) for k in records[0]}


def _split_error(builder, split: str, field: str, e: Exception) -> ValueError:
  return ValueError(
      f"config.{field}={split!r} is not a split of {builder.info.name!r} (its splits: "
      f"{', '.join(sorted(builder.info.splits))}; a TFDS slice such as "
      f"'train[:10%]' or 'test[:1000]' also works): {e}")


def data_source(builder, split: str, field: str = "split"):
  """The random-access TFDS data source of a split of an array_record-prepared builder.

  Raises:
    ValueError: `split` names no split of the dataset (the message names the
      config `field` it came from).
  """
  try:
    return builder.as_data_source(split=split)
  except (ValueError, KeyError, AssertionError) as e:
    raise _split_error(builder, split, field, e) from e


def train_batches(split: Split, batch_size: int, seed: int, start_step: int = 0,
                  rows: slice = slice(None), permutation: Callable[[int], np.ndarray] | None = None
                  ) -> Iterator[dict[str, np.ndarray]]:
  """Endless shuffled batches; batch s is a pure function of (seed, s).

  Each epoch is a fresh permutation; the last partial batch of an epoch is
  dropped, so every training batch has the global batch size. `rows` picks
  the rows a process feeds (`trainer.strategy.process_slice(batch_size)`):
  only those examples are read, and the global batch does not depend on the
  number of processes. `permutation(epoch)` replaces the epoch's order
  (`DeviceData.permutation`, to feed the device pipeline's order from the host).

  Raises:
    ValueError: the split holds fewer examples than one batch.
  """
  steps_per_epoch = len(split) // batch_size
  if steps_per_epoch == 0:
    raise ValueError(f"config.batch_size={batch_size} exceeds the {len(split)} training "
                     f"examples.")
  step, epoch, order = start_step, None, None
  while True:
    e, i = divmod(step, steps_per_epoch)
    if e != epoch:
      epoch = e
      order = (np.asarray(permutation(e)) if permutation is not None
               else np.random.default_rng((seed, e)).permutation(len(split)))
    yield split.batch(order[i * batch_size:(i + 1) * batch_size][rows])
    step += 1


def eval_batches(split: Split, batch_size: int) -> Iterator[dict[str, np.ndarray]]:
  """The whole split in order; the last batch may be short (the Trainer pads it)."""
  for start in range(0, len(split), batch_size):
    yield split.batch(np.arange(start, min(start + batch_size, len(split))))


def num_train_steps(config: ml_collections.ConfigDict, num_train_examples: int) -> int:
  """`num_train_steps` when positive, else `num_epochs` whole epochs of batches."""
  if config.num_train_steps > 0:
    return config.num_train_steps
  if config.num_epochs <= 0:
    raise ValueError(f"config.num_epochs={config.num_epochs} must be positive when "
                     f"config.num_train_steps={config.num_train_steps} is not.")
  return config.num_epochs * (num_train_examples // config.batch_size)
