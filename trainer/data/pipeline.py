"""Streamed training data: Grain over a TFDS data source (array_record), read per process.

For datasets that do not fit in memory. TFDS prepares the dataset as
array_record files, which `tfds.data_source` reads by index with no
TensorFlow in the loop; Grain turns that into batches:

- the whole dataset is shuffled with `config.seed` (a new order each epoch,
  Grain's `shuffle` then `repeat`) and cut into blocks of the rows one
  process feeds; global batch s is blocks `s*c .. s*c + c - 1`, where c is the
  number of processes that feed distinct rows (the strategy's process layout, `process_rows`);
- each process reads only its own blocks (`ShardByJaxProcess` where every
  process feeds distinct rows; a strategy whose processes all need the whole
  batch, such as an ensemble with members spread over processes, reads it
  everywhere), so the global batch is the same for any number of processes;
- records are read and decoded by Grain's reader threads ahead of the loop
  (`read_threads`, `prefetch_batches`); the Trainer then places batches on
  the devices ahead of their step (`config.prefetch_to_device`);
- the iterator's position (`get_state()`) is saved with every checkpoint and
  restored on resume, so a resumed run reads exactly the batches an
  uninterrupted one would. The position is the global batch index
  (`{"global_batch": s}`), the same on every process and for any number of
  processes, because global batch s is the same rows in any layout: a run saved
  by 2 processes resumes on 1, or on 4, where it stopped (a position-as-step
  source; see `ELASTIC_STATE_KEYS`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import grain
import jax
import numpy as np

Batch = dict[str, np.ndarray]

#: Keys of an iterator state that is a position in the global stream, valid for any
#: number of processes: this module's (`"global_batch"`), Grain's
#: `grain.experimental.ElasticIterator`'s (`"global_next_index"`), and a text corpus's
#: lanes (`trainer.data.lm`, valid for any process count that divides its lanes). Any other
#: checkpointed state is taken to be one process's and resumes only on the process
#: layout that saved it (`trainer.data.feed.check_resumable`).
ELASTIC_STATE_KEYS = ("global_batch", "global_next_index", "corpus_lanes")


def shard_options(process_rows: tuple[int, int]) -> grain.sharding.ShardOptions:
  """Grain shard options for a process that feeds block `index` of `count` of every batch.

  `ShardByJaxProcess` when the blocks are the processes (data parallelism
  over all of them); plain `ShardOptions` otherwise (e.g. every process
  feeding the whole batch: one shard).
  """
  index, count = process_rows
  if (index, count) == (jax.process_index(), jax.process_count()):
    return grain.sharding.ShardByJaxProcess(drop_remainder=True)
  return grain.sharding.ShardOptions(shard_index=index, shard_count=count, drop_remainder=True)


def image_batch(records: Batch) -> Batch:
  """A batch of TFDS image records as the Trainer takes it: float images in [0, 1]."""
  return {"image": np.asarray(records["image"], np.float32) / 255.0,
          "label": np.asarray(records["label"], np.int32)}


class GrainBatches:
  """`start_step -> iterator` of this process's rows of each training batch (Grain).

  The iterator is Grain's: it has `get_state()` / `set_state()`, which the
  Trainer saves with each checkpoint and restores on resume.

  Args:
    source: a random-access data source (`tfds.data_source(...)`, anything
      with `__len__` and `__getitem__`).
    batch_size: the global batch size.
    seed: the shuffle seed; batch s depends on (seed, s) only.
    shard: which rows this process reads (`shard_options`).
    transform: applied to each stacked batch of records.
    read_threads: Grain reader threads (0: read in the calling thread).
    prefetch_batches: how many batches the readers keep ready.
  """

  def __init__(self, source: Sequence, *, batch_size: int, seed: int,
               shard: grain.sharding.ShardOptions,
               transform: Callable[[Batch], Batch] = image_batch, read_threads: int = 4,
               prefetch_batches: int = 8):
    if batch_size % shard.shard_count:
      raise ValueError(f"config.batch_size={batch_size} does not split into the "
                       f"{shard.shard_count} blocks that the processes read.")
    if len(source) < batch_size:
      raise ValueError(f"config.batch_size={batch_size} exceeds the {len(source)} training "
                       f"examples.")
    if not isinstance(read_threads, int) or read_threads < 0:
      raise ValueError(f"config.data.read_threads={read_threads!r} must be an integer >= 0.")
    if not isinstance(prefetch_batches, int) or prefetch_batches < 0:
      raise ValueError(f"config.data.prefetch_batches={prefetch_batches!r} must be an "
                       f"integer >= 0.")
    rows = batch_size // shard.shard_count
    dataset = grain.MapDataset.source(source).seed(seed).shuffle().repeat()
    dataset = dataset.batch(rows, drop_remainder=True)  # Blocks of one process's rows.
    dataset = dataset[shard.shard_index::shard.shard_count]  # This process's blocks.
    self.dataset = dataset.map(transform)
    self.read_options = grain.ReadOptions(num_threads=read_threads,
                                          prefetch_buffer_size=prefetch_batches)

  def __call__(self, start_step: int = 0) -> BatchIterator:
    return BatchIterator(iter(self.dataset.to_iter_dataset(self.read_options)), start_step)


class BatchIterator:
  """This process's rows of global batches `start, start + 1, ...`, read by Grain.

  Its state is `{"global_batch": s}`, the index of the next global batch: the same
  on every process and for any number of processes (`ELASTIC_STATE_KEYS`).
  """

  def __init__(self, iterator: grain.DatasetIterator, start: int = 0):
    self._iterator = iterator
    self._next = 0
    if start:
      self.set_state({"global_batch": start})

  def __iter__(self) -> BatchIterator:
    return self

  def __next__(self) -> Batch:
    batch = next(self._iterator)
    self._next += 1
    return batch

  def get_state(self) -> dict[str, int]:
    return {"global_batch": self._next}

  def set_state(self, state: dict[str, int]) -> None:
    """Positions the iterator at a saved state (a checkpoint of an earlier release holds
    Grain's own `{"next_index": s}`, which meant the same)."""
    position = state.get("global_batch", state.get("next_index"))
    if not isinstance(position, int) or position < 0:
      raise ValueError(f"train data state {state!r} is not a Grain pipeline position "
                       f"{{'global_batch': s}} with s >= 0.")
    grain_state = self._iterator.get_state()
    if set(grain_state) != {"next_index"}:  # The one place that knows Grain's state format.
      raise RuntimeError(f"unexpected Grain iterator state {grain_state}; cannot start at "
                         f"global batch {position}.")
    self._iterator.set_state({"next_index": position})
    self._next = position


def eval_batches(source: Sequence, batch_size: int,
                 transform: Callable[[Batch], Batch] = image_batch) -> Iterator[Batch]:
  """The whole source in order, in global batches (the last may be short; the Trainer pads)."""
  dataset = grain.MapDataset.source(source).batch(batch_size).map(transform)
  yield from dataset
