"""The Grain pipeline (trainer/pipeline.py) and the device feed (trainer/feed.py)."""

import grain
import jax
import numpy as np
import pytest
from conftest import cnn_config
from user_models import NnxBatchNormTrainer

from trainer.checkpoint import Checkpointer
from trainer.data import pipeline
from trainer.data.feed import DeviceFeed, check_resumable


def records(n: int, seed: int = 0) -> list[dict]:
  """A random-access source of n MNIST-like records (what `tfds.data_source` yields)."""
  rng = np.random.default_rng(seed)
  return [{"image": rng.integers(0, 256, (28, 28, 1), dtype=np.uint8),
           "label": np.int64(rng.integers(0, 10))} for _ in range(n)]


def take(iterator, n):
  return [next(iterator) for _ in range(n)]


def shard(index, count):
  return grain.sharding.ShardOptions(shard_index=index, shard_count=count, drop_remainder=True)


def test_the_blocks_of_two_processes_make_the_one_process_batch():
  source = records(40)  # 5 batches of 8 per epoch; 12 steps cross two epoch boundaries.
  whole = take(pipeline.GrainBatches(source, batch_size=8, seed=3, shard=shard(0, 1))(), 12)
  halves = [take(pipeline.GrainBatches(source, batch_size=8, seed=3, shard=shard(i, 2))(), 12)
            for i in range(2)]
  for step, batch in enumerate(whole):
    assert batch["image"].shape == (8, 28, 28, 1) and batch["image"].dtype == np.float32
    for key in batch:
      np.testing.assert_array_equal(
          batch[key], np.concatenate([halves[0][step][key], halves[1][step][key]]))
  # Each epoch is a new order of all 40 records.
  labels = lambda bs: np.concatenate([b["image"][:, 0, 0, 0] for b in bs])  # noqa: E731
  first, second = labels(whole[:5]), labels(whole[5:10])
  assert sorted(first) == sorted(second) and not np.array_equal(first, second)


def test_the_saved_state_and_the_start_step_continue_the_stream():
  batches = pipeline.GrainBatches(records(40), batch_size=8, seed=1, shard=shard(1, 2),
                                  read_threads=2)
  iterator = batches()
  take(iterator, 4)
  state = iterator.get_state()
  rest = take(iterator, 5)
  restored = batches()
  restored.set_state(state)
  for want, a, b in zip(rest, take(restored, 5), take(batches(4), 5), strict=True):
    for key in want:
      np.testing.assert_array_equal(a[key], want[key])
      np.testing.assert_array_equal(b[key], want[key])


def test_the_position_is_global_and_moves_to_another_number_of_processes():
  source = records(40)
  two = pipeline.GrainBatches(source, batch_size=8, seed=2, shard=shard(1, 2))()
  take(two, 7)  # Into the second epoch.
  state = two.get_state()
  assert state == {"global_batch": 7}
  one = pipeline.GrainBatches(source, batch_size=8, seed=2, shard=shard(0, 1))
  resumed = one()
  resumed.set_state(state)
  want = take(one(), 10)[7:]
  for got, expected in zip(take(resumed, 3), want, strict=True):
    np.testing.assert_array_equal(got["image"], expected["image"])
  # A checkpoint of an earlier release holds Grain's own state; it meant the same.
  earlier = one()
  earlier.set_state({"next_index": 7})
  np.testing.assert_array_equal(next(earlier)["image"], want[0]["image"])
  with pytest.raises(ValueError, match=r"state \{'position': 3\} is not a Grain pipeline"):
    one().set_state({"position": 3})


def test_a_per_process_data_state_is_refused_on_another_process_layout():
  saved = {"processes": 2, "devices": 8, "data_shards": 2}
  now = {"processes": 1, "devices": 4, "data_shards": 1}
  with pytest.raises(ValueError, match=r"checkpoint /ckpt/4 was saved by 2 process\(es\), 8 "
                     r"devices, 2 data shard\(s\) with the train data iterator's state "
                     r"\{'next_index': 12\}; this run has 1 process\(es\), 4 devices, 1 data "
                     r"shard\(s\).*GrainBatches, grain.experimental.ElasticIterator"):
    check_resumable({"next_index": 12}, saved, now, "/ckpt/4")
  for elastic in ({"global_batch": 4}, {"global_next_index": 64}):
    check_resumable(elastic, saved, now, "/ckpt/4")
  check_resumable({"next_index": 12}, saved, {**now, "data_shards": 2}, "/ckpt/4")
  check_resumable({"next_index": 12}, {}, now, "/ckpt/4")  # Saved by an earlier release.


class PerProcessIterator:
  """A checkpointable iterator whose state is a position in one process's data."""

  def __init__(self, source):
    self.source, self.index = source, 0

  def __iter__(self):
    return self

  def __next__(self):
    batch = pipeline.image_batch({k: np.stack([r[k] for r in self.source[self.index:][:16]])
                                  for k in ("image", "label")})
    self.index += 16
    return batch

  def get_state(self):
    return {"index": self.index}

  def set_state(self, state):
    self.index = state["index"]


def test_fit_refuses_a_per_process_position_saved_by_another_process_layout(tmp_path):
  import json
  source = records(96)
  _fit(tmp_path, 3, lambda start: PerProcessIterator(source), prefetch=0)
  # As if 2 processes had saved it, each reading its half of every batch.
  metadata = tmp_path / "3" / "layout" / "metadata"
  layout = json.loads(metadata.read_text())
  assert layout["shape"] == {"processes": 1, "devices": 1, "data_shards": 1}
  layout["shape"] = {"processes": 2, "devices": 8, "data_shards": 2}
  metadata.write_text(json.dumps(layout))
  with pytest.raises(ValueError, match=r"saved by 2 process\(es\).*state \{'index': 48\}"):
    _fit(tmp_path, 6, lambda start: PerProcessIterator(source), prefetch=0)
  checkpointer = Checkpointer(tmp_path)
  assert checkpointer.all_steps() == [3]  # Nothing trained or saved.
  checkpointer.close()


def test_bad_pipeline_settings_name_the_field():
  with pytest.raises(ValueError, match=r"config.data.read_threads=-1"):
    pipeline.GrainBatches(records(16), batch_size=8, seed=0, shard=shard(0, 1), read_threads=-1)
  with pytest.raises(ValueError, match=r"config.batch_size=32 exceeds the 16 training"):
    pipeline.GrainBatches(records(16), batch_size=32, seed=0, shard=shard(0, 1))
  with pytest.raises(ValueError, match=r"config.prefetch_to_device=-1 must be an integer >= 0"):
    NnxBatchNormTrainer(cnn_config(prefetch_to_device=-1))


def _fit(workdir, num_steps, train_batches, prefetch):
  trainer = NnxBatchNormTrainer(cnn_config(prefetch_to_device=prefetch, dropout_rate=0.1))
  checkpointer = Checkpointer(workdir, every_steps=3)
  try:
    result = trainer.fit(train_batches, num_steps=num_steps, checkpointer=checkpointer)
  finally:
    checkpointer.close()
  return trainer.strategy.to_canonical(result.state.params)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_fit_saves_the_grain_position_and_a_resumed_run_reads_on_exactly(tmp_path, prefetch):
  source = records(48)
  batches = pipeline.GrainBatches(source, batch_size=16, seed=0, shard=shard(0, 1))
  want = _fit(tmp_path / "whole", 7, batches, prefetch)

  # The resumed run's iterator would start at 0: only the checkpoint's state positions it.
  from_zero = lambda start: batches(0)  # noqa: E731
  _fit(tmp_path / "resumed", 3, from_zero, prefetch)
  checkpointer = Checkpointer(tmp_path / "resumed", every_steps=3)
  assert checkpointer.data_state(3) == {"global_batch": 3}
  checkpointer.close()
  got = _fit(tmp_path / "resumed", 7, from_zero, prefetch)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_array_equal(a, b)


def test_the_feed_places_batches_ahead_and_raises_a_bad_one_at_its_step():
  read, placed = [], []

  def batches():
    for i in range(6):
      read.append(i)
      yield i

  def check(batch, step):
    assert batch == step
    if step == 3:
      raise ValueError("bad batch 3")

  feed = DeviceFeed(batches(), 0, check=check, put=lambda b: placed.append(b) or b, ahead=2,
                    stop_step=5)
  assert feed.next() == (0, None)
  feed.fill()
  assert read == [0, 1, 2] and placed == [0, 1, 2]  # Steps 1 and 2 wait on the devices.
  assert feed.next()[0] == 1
  feed.fill()
  assert read == [0, 1, 2, 3]  # Batch 3 failed its check; its step has not come.
  assert feed.next()[0] == 2
  feed.fill()
  assert read == [0, 1, 2, 3, 4]  # Never beyond the run's last step (stop_step=5).
  with pytest.raises(ValueError, match="bad batch 3"):
    feed.next()


def test_a_resumed_run_sets_the_saved_position_before_reading_a_batch(tmp_path):
  """A checkpointable iterator is positioned before its first read: one that can only reach
  step `start` by reading from its beginning (a text stream) is not read through the steps
  already trained, and reads each step's batch once."""
  source, events = records(96), []

  class Recording(PerProcessIterator):
    def __next__(self):
      events.append(("next", self.index))
      return super().__next__()

    def set_state(self, state):
      events.append(("set_state", state["index"]))
      super().set_state(state)

  _fit(tmp_path, 3, lambda start: Recording(source), prefetch=0)
  assert events == [("next", 16 * i) for i in range(3)]
  events.clear()
  _fit(tmp_path, 5, lambda start: Recording(source), prefetch=0)
  assert events == [("set_state", 48), ("next", 48), ("next", 64)]
