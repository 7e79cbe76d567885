"""TFDS preparation from manual files, deterministic order, and data errors."""

import gzip
import shutil

import numpy as np
import pytest
import tensorflow_datasets as tfds
from conftest import mock_tfds
from doc_commands import MNIST_DIR

from trainer import data


def _fake_manual_dir(tmp_path, skip=None, corrupt=None):
  """Small valid IDX files (a missing or corrupt one on request)."""
  for name, (magic, shape) in data.MNIST_FILES.items():
    if name == skip:
      continue
    header = np.array([magic, *shape], ">u4").tobytes()
    payload = header + bytes(int(np.prod(shape)))
    if name == corrupt:
      payload = payload[: len(payload) // 2]  # Truncated: the header promises more.
    with gzip.open(tmp_path / name, "wb", compresslevel=1) as f:
      f.write(payload)
  return tmp_path


def test_missing_idx_file_is_named(tmp_path):
  manual = _fake_manual_dir(tmp_path, skip="t10k-labels-idx1-ubyte.gz")
  with pytest.raises(FileNotFoundError, match="t10k-labels-idx1-ubyte.gz is missing"):
    data.prepare("mnist", str(tmp_path / "tfds"), str(manual))
  assert not (tmp_path / "tfds").exists()


def test_truncated_idx_file_is_named(tmp_path):
  manual = _fake_manual_dir(tmp_path, corrupt="train-labels-idx1-ubyte.gz")
  with pytest.raises(ValueError, match="train-labels-idx1-ubyte.gz is corrupt"):
    data.prepare("mnist", str(tmp_path / "tfds"), str(manual))


def test_non_gzip_idx_file_is_named(tmp_path):
  manual = _fake_manual_dir(tmp_path)
  (manual / "t10k-images-idx3-ubyte.gz").write_bytes(b"not a gzip file")
  with pytest.raises(ValueError, match="t10k-images-idx3-ubyte.gz is corrupt"):
    data.prepare("mnist", str(tmp_path / "tfds"), str(manual))


def test_prepared_data_reads_no_manual_file(tmp_path, monkeypatch):
  """Once TFDS holds the data, a run with config.data.manual_dir starts without reading
  (or checking) the IDX files again."""
  prepared = []
  monkeypatch.setattr(tfds.core.DatasetBuilder, "is_prepared", lambda self: True)
  monkeypatch.setattr(tfds.core.DatasetBuilder, "download_and_prepare",
                      lambda self, **kwargs: prepared.append(kwargs))
  data.prepare("mnist", str(tmp_path / "tfds"), str(tmp_path / "no_manual_files"))
  assert len(prepared) == 1  # TFDS's own call, which returns at once for prepared data.


def test_real_files_pass_the_check():
  if not MNIST_DIR.is_dir():
    pytest.skip("real MNIST files not found")
  for name, (magic, shape) in data.MNIST_FILES.items():
    data.check_idx_file(str(MNIST_DIR / name), magic, shape)


def test_no_network_and_no_manual_dir_says_how_to_fix(tmp_path, monkeypatch):
  def offline(self, *args, **kwargs):
    raise ConnectionError("network is unreachable")

  monkeypatch.setattr(tfds.core.DatasetBuilder, "download_and_prepare", offline)
  with pytest.raises(RuntimeError, match=r"set config\.data\.manual_dir \(or the "
                                         r"TFDS_MANUAL_DIR environment variable\)"):
    data.prepare("mnist", str(tmp_path), "")


def _split(n=50):
  return data.Split(images=np.arange(n * 4, dtype=np.uint8).reshape(n, 2, 2, 1),
                    labels=np.arange(n, dtype=np.int32))


def test_train_order_is_a_function_of_seed_and_step():
  split = _split()
  straight = data.train_batches(split, batch_size=8, seed=3)
  first = [next(straight)["label"] for _ in range(20)]
  resumed = data.train_batches(split, batch_size=8, seed=3, start_step=13)
  for step in range(13, 20):
    np.testing.assert_array_equal(next(resumed)["label"], first[step])
  # 6 batches an epoch; each epoch is a permutation without repeats.
  epoch = np.concatenate(first[:6])
  assert len(set(epoch.tolist())) == 48
  assert not np.array_equal(np.concatenate(first[6:12]), epoch)
  other_seed = data.train_batches(split, batch_size=8, seed=4)
  assert not np.array_equal(next(other_seed)["label"], first[0])


def test_eval_batches_cover_the_split_once():
  batches = list(data.eval_batches(_split(), batch_size=16))
  assert [len(b["label"]) for b in batches] == [16, 16, 16, 2]
  np.testing.assert_array_equal(np.concatenate([b["label"] for b in batches]), np.arange(50))
  assert batches[0]["image"].dtype == np.float32 and batches[0]["image"].max() <= 1.0


def test_num_train_steps_prefers_steps_over_epochs():
  import ml_collections
  config = ml_collections.ConfigDict({"num_train_steps": -1, "num_epochs": 2, "batch_size": 128})
  assert data.num_train_steps(config, 60000) == 2 * 468
  config.num_train_steps = 7
  assert data.num_train_steps(config, 60000) == 7


def test_prepare_from_real_files_is_offline(tmp_path):
  """Only the checker runs on the real files here; the example test prepares them."""
  if not MNIST_DIR.is_dir():
    pytest.skip("real MNIST files not found")
  manual = tmp_path / "manual"
  shutil.copytree(MNIST_DIR, manual)
  (manual / "train-labels-idx1-ubyte.gz").unlink()
  with pytest.raises(FileNotFoundError, match="train-labels-idx1-ubyte.gz"):
    data.prepare("mnist", str(tmp_path / "tfds"), str(manual))


def test_the_grain_pipeline_refuses_a_dataset_prepared_as_tfrecord(tmp_path):
  if not MNIST_DIR.is_dir():
    pytest.skip("real MNIST files not found")
  # As an older version of this project prepared it for the memory pipeline: its format is
  # what matters, so TFDS writes the first 10 examples of each split, not 70,000 (26 s).
  tfds.builder("mnist", data_dir=str(tmp_path), file_format="tfrecord").download_and_prepare(
      download_config=tfds.download.DownloadConfig(manual_dir=str(MNIST_DIR),
                                                   max_examples_per_split=10))
  builder = data.prepare("mnist", str(tmp_path), str(MNIST_DIR), file_format="tfrecord")
  assert builder.info.file_format.value == "tfrecord"
  assert len(data.load_split(builder, "test[:10]")) == 10
  with pytest.raises(ValueError, match=r"config.data.pipeline='grain' reads 'mnist' prepared "
                                       r"as array_record, but .* holds it as tfrecord"):
    data.prepare("mnist", str(tmp_path), str(MNIST_DIR), file_format="array_record")


def test_split_slices_and_unknown_splits(real_mnist_run, doc_runner):
  # MNIST as the README's first command prepared it (mock_data ignores slices).
  builder = tfds.builder("mnist", data_dir=str(doc_runner.data_dir))
  part = data.load_split(builder, "test[:1000]")
  assert len(part) == 1000
  np.testing.assert_array_equal(part.labels, data.load_split(builder, "test").labels[:1000])
  with pytest.raises(ValueError, match=r"config\.data\.eval_split='tset' is not a split of "
                                       r"'mnist' \(its splits: test, train"):
    data.load_split(builder, "tset", field="data.eval_split")


def test_every_pipeline_prepares_new_data_in_the_format_grain_reads(tmp_path, real_mnist_run,
                                                                     doc_runner):
  """The in-memory and device pipelines (file_format None) prepare new data as array_record,
  so a Grain command run after theirs reads the same data directory; and they read what
  Grain prepared (the README's first command, in the session's data directory)."""
  with mock_tfds(10):
    assert data.prepare("mnist", str(tmp_path), None).info.file_format.value == "array_record"
  grain = data.prepare("mnist", str(doc_runner.data_dir), None, file_format="array_record")
  assert len(data.data_source(grain, "test[:10]", field="data.eval_split")) == 10
  memory = data.prepare("mnist", str(doc_runner.data_dir), None)
  assert len(data.load_split(memory, "test[:10]")) == 10
