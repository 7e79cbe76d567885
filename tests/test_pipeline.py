"""The Grain pipeline (trainer/pipeline.py) and the device feed (trainer/feed.py)."""

import grain
import jax
import numpy as np
import pytest
from conftest import cnn_config
from user_models import NnxBatchNormTrainer

from trainer.checkpoint import Checkpointer
from trainer.data import pipeline
from trainer.data.feed import DeviceFeed


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
  assert checkpointer.data_state(3) == {"next_index": 3}
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
