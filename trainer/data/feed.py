"""Train batches on their way to the devices: checked, placed ahead of the step, positioned.

`DeviceFeed` pulls host batches from the data iterator, checks each, and
hands it to the strategy's `put_batch` `ahead` steps before the step that
consumes it, so that reading and copying a batch overlap the step before it
(dispatch is asynchronous: the host is free while a step runs). A batch that
fails its check raises when its step comes, not earlier, so the steps
before it run and save as they would have.

A data iterator with `get_state()` / `set_state()` (a Grain iterator, see
`trainer.data.pipeline`) is checkpointable: the feed records its state right after
each batch is read, so the state saved with checkpoint `s` is the iterator's
position after the batch of step `s - 1`, however far the feed has read ahead.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import numpy as np

from strategies.tree import keypath_str

PyTree = Any


def check_train_batch(batch: PyTree, step: int, *, batch_size: int, rows: slice) -> None:
  """Raises unless every array of the batch for `step` holds this process's `rows` of a
  `batch_size` batch (all of them on one process).

  Raises:
    ValueError: naming the step, the entry, its shape and what it must hold.
  """
  from trainer.data.packing import check_packed
  want = rows.stop - rows.start
  check_packed(batch, where=f"the train batch for step {step}")
  for path, x in jax.tree_util.tree_leaves_with_path(batch):
    if np.ndim(x) and np.shape(x)[0] == want:
      continue
    got = f"{np.shape(x)[0]} examples" if np.ndim(x) else "a scalar"
    if want != batch_size:
      raise ValueError(
          f"the train batch for step {step} holds {got} in {keypath_str(path)!r} (shape "
          f"{np.shape(x)}), but process {jax.process_index()} of {jax.process_count()} "
          f"feeds rows {rows.start}:{rows.stop} of each config.batch_size={batch_size} "
          f"batch, {want} examples; give each process its rows "
          f"(trainer.strategy.process_slice(batch_size)), not the whole batch.")
    raise ValueError(
        f"the train batch for step {step} holds {got} in {keypath_str(path)!r} (shape "
        f"{np.shape(x)}) but config.batch_size={want}; every train batch must hold "
        f"exactly batch_size examples (the step is compiled for that shape). Drop the "
        f"short last batch of an epoch (tf.data: drop_remainder=True) or pad it.")


def describe_shape(shape: Mapping[str, int]) -> str:
  """'2 processes x 8 devices, 2 data shards' for a checkpoint's `shape` record."""
  return (f"{shape.get('processes')} process(es), {shape.get('devices')} devices, "
          f"{shape.get('data_shards')} data shard(s)")


def check_resumable(data_state: Any, saved: Mapping[str, int], now: Mapping[str, int],
                    where: str) -> None:
  """Raises where a checkpoint's train data position cannot carry over to this run.

  A position in the global stream (`pipeline.ELASTIC_STATE_KEYS`: the Grain pipeline's,
  Grain's `ElasticIterator`'s) resumes on any number of processes; any other iterator
  state is taken to be a position in one process's shard of the data, which means
  nothing to a run whose processes read another number of shards.

  Args:
    saved, now: the machine shapes (`trainer.checkpoint.run_state.run_shape`) of the
      run that saved the checkpoint (empty for earlier releases) and of this one.

  Raises:
    ValueError: naming the checkpoint, both shapes, the state and what resumes.
  """
  from trainer.data.pipeline import ELASTIC_STATE_KEYS
  if data_state is None or not saved or saved.get("data_shards") == now.get("data_shards"):
    return
  if isinstance(data_state, Mapping) and any(k in data_state for k in ELASTIC_STATE_KEYS):
    return
  raise ValueError(
      f"checkpoint {where} was saved by {describe_shape(saved)} with the train data "
      f"iterator's state {data_state!r}; this run has {describe_shape(now)}. That state is "
      f"a position in one process's shard of the data and cannot be moved to another "
      f"number of shards. Resume on the saved process layout, or feed the data from a "
      f"source whose position is global: trainer.data.pipeline.GrainBatches, "
      f"grain.experimental.ElasticIterator, or train_batches as a function "
      f"start_step -> batches.")


def is_checkpointable(iterator: Any) -> bool:
  """Whether a data iterator can save and restore its position (Grain's can)."""
  return callable(getattr(iterator, "get_state", None)) and callable(
      getattr(iterator, "set_state", None))


class DeviceFeed:
  """Placed batches for steps `start, start + 1, ...`, each put `ahead` calls early.

  With `sizes`, each call takes several steps' batches, stacked on a leading
  step axis and placed together (`Strategy.put_batches`).

  Args:
    batches: host batches; the first is the batch for step `start`.
    start: the step of the first batch.
    check: `(host batch, step) -> None`, raises for a batch that cannot run.
    put: `host batch -> placed batch` (the strategy's `put_batch`), or with
      `sizes`, `stacked host batches -> placed` (`put_batches`).
    ahead: how many calls' batches beyond the one being consumed are placed (0: none).
    stop_step: no batch is read for this step or later ones.
    state_of: the data iterator's `get_state`, when it has one.
    sizes: `step -> how many steps the call starting there runs`; None: one, unstacked.
  """

  def __init__(self, batches: Iterator[PyTree], start: int, *,
               check: Callable[[PyTree, int], None], put: Callable[[PyTree], PyTree],
               ahead: int = 1, stop_step: int | None = None,
               state_of: Callable[[], Any] | None = None,
               sizes: Callable[[int], int] | None = None):
    self._batches = batches
    self._step = start
    self._stop_step = stop_step
    self._check, self._put, self._ahead, self._state_of = check, put, ahead, state_of
    self._sizes = sizes
    self._queue: collections.deque = collections.deque()
    self._exhausted = False
    #: How many steps the batches `next` handed out last are for.
    self.last_steps = 0

  def _read_one(self) -> bool:
    """Reads, checks and places the next call's batches; False when there are none."""
    if self._exhausted or (self._stop_step is not None and self._step >= self._stop_step):
      return False
    want = self._sizes(self._step) if self._sizes else 1
    read, state, error = [], None, None
    while len(read) < want and error is None:
      try:
        batch = next(self._batches)
      except StopIteration:
        self._exhausted = True
        break
      state = self._state_of() if self._state_of else None
      try:
        self._check(batch, self._step + len(read))
      except Exception as e:  # Raised when its call comes.
        error = e
      read.append(batch)
    if not read:
      return False
    if error is None:
      try:
        placed = (self._put(jax.tree.map(lambda *xs: np.stack(xs), *read)) if self._sizes
                  else self._put(read[0]))
      except Exception as e:
        error = e
    self._queue.append((None if error else placed, state, error, len(read)))
    self._step += len(read)
    return True

  def fill(self) -> None:
    """Reads and places batches until `ahead` are waiting (or the run's last is)."""
    while len(self._queue) < self._ahead and self._read_one():
      pass

  def next(self) -> tuple[PyTree, Any]:
    """`(placed batch, data state after it)` for the next call (`last_steps` steps).

    Raises:
      StopIteration: the data ran out.
      Exception: the batch's check failed (or placing it did).
    """
    if not self._queue and not self._read_one():
      raise StopIteration
    placed, state, error, self.last_steps = self._queue.popleft()
    if error is not None:
      raise error
    return placed, state
