"""Evaluation and prediction over host batches of any size.

Each batch is cut into `eval_batch_size` chunks, and each chunk is padded up
to a size the strategy's data replicas split evenly, with a 0/1 `mask` entry
marking the real examples: one compiled shape for every chunk, and results
that do not depend on `eval_batch_size` or the strategy.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import jax
import numpy as np

from strategies import Strategy
from trainer import metrics as metrics_lib
from trainer.step.functions import CompiledSteps, batch_size_of

Batch = Mapping[str, Any]
PyTree = Any

#: The batch entry that marks real (1) and padding (0) examples of an eval chunk.
MASK_KEY = "mask"


def wait_for_previous_call(outputs: list) -> None:
  """Keeps one compiled call queued behind the running one: blocks on the call before the last.

  On XLA:CPU with several (fake) devices, many queued programs that contain
  collectives deadlocked in the collective's rendezvous ("Expected 8 threads to
  join the rendezvous") at XLA's default thread pool: measured here, back-to-back
  train steps or eval calls under `sharded_data_parallel` hung within 2000 calls,
  while the same calls with one in flight ran 2000 train steps and 4000 eval
  calls. Each waiting device holds a pool thread, and the waits filled the pool;
  `trainer.distributed.devices.reserve_host_threads` now gives it room. The bound
  stays: waiting on the previous call costs no device time, since the next one is
  already queued, and it holds one call's outputs at a time.
  """
  if len(outputs) > 1:
    jax.block_until_ready(outputs[-2])


def pad_batch(batch: Batch, size: int) -> dict[str, np.ndarray]:
  """Pads a host batch to `size` examples and adds a 0/1 `mask` of the real ones.

  Raises:
    ValueError: the batch is larger than `size`.
  """
  n = batch_size_of(batch)
  if n > size:
    raise ValueError(f"an eval batch of {n} examples exceeds the eval batch size {size}")
  padded = {k: np.concatenate([np.asarray(v), np.zeros((size - n,) + np.shape(v)[1:],
                                                        np.asarray(v).dtype)])
            for k, v in batch.items() if k != MASK_KEY}
  mask = np.asarray(batch.get(MASK_KEY, np.ones(n)), np.float32)
  padded[MASK_KEY] = np.concatenate([mask, np.zeros(size - n, np.float32)])
  return padded


class Evaluator:
  """Runs the compiled eval and predict steps over host batches, chunked and padded.

  Args:
    strategy: places each process's rows of a chunk and brings results back.
    compiled: the Trainer's compiled steps.
    eval_batch_size: examples per chunk (any positive size).

  Raises:
    ValueError: `eval_batch_size` is not a positive integer.
  """

  def __init__(self, strategy: Strategy, compiled: CompiledSteps, eval_batch_size: int):
    if not isinstance(eval_batch_size, int) or eval_batch_size < 1:
      raise ValueError(f"config.eval_batch_size={eval_batch_size!r} must be a positive "
                       f"integer (any size: eval batches are padded to split evenly).")
    self.strategy, self.compiled, self.eval_batch_size = strategy, compiled, eval_batch_size
    unit = strategy.batch_multiple  # The data replicas (times a pipeline's microbatches).
    self._padded_size = -(-eval_batch_size // unit) * unit
    self._traced = False
    self._last_pass: tuple[Callable, weakref.ref, list] | None = None  # See `one_set`.

  def chunks(self, batch: Batch) -> Iterator[tuple[dict[str, np.ndarray], int]]:
    """`(padded chunk, real examples)` for `eval_batch_size` slices of a host batch (of
    each member's rows, where each member reads its own: `Strategy.batch_models`)."""
    models = self.strategy.model_batches(batch)
    n = batch_size_of(models[0])
    for start in range(0, n, self.eval_batch_size):
      parts = [pad_batch({k: np.asarray(v)[start:start + self.eval_batch_size]
                          for k, v in one.items()}, self._padded_size) for one in models]
      chunk = ({k: np.stack([p[k] for p in parts]) for k in parts[0]}
               if self.strategy.batch_models else parts[0])
      yield chunk, min(self.eval_batch_size, n - start)

  def _put(self, chunk: Batch) -> PyTree:
    """A padded global chunk on devices, each process putting its own rows."""
    return self.strategy.put_batch(self.strategy.local_rows(chunk))

  def trace(self, state, train_batch: Batch,
            eval_batches: Callable[[], Iterable[Batch]] | None) -> None:
    """Traces the eval and predict steps once, so their errors show before training.

    The example is the first eval batch if there are eval batches, else the
    first train batch (this process's rows, repeated to the global shape); it
    is read only while the steps are still untraced. A jitted step is traced only
    (`.trace`: jit keeps the trace for its first call); lowering it to XLA's input waits
    for that call, so a run that never evaluates or predicts never lowers them (profiled
    with a warm compilation cache, the two lowerings were 8% of the samples of
    `tests/test_steps_per_call.py` and `tests/test_pipeline_parallel.py`). A step with no
    `.trace` (`jax.pmap`'s) is lowered, which traces it.
    """
    if self._traced:
      return
    example = next(iter(eval_batches()), None) if eval_batches is not None else None
    if example is None:
      count = self.strategy.process_rows()[1]
      example = jax.tree.map(lambda x: np.concatenate([np.asarray(x)] * count), train_batch)
    chunk = self._put(next(self.chunks(example))[0])
    for compiled in (self.compiled.eval(state), self.compiled.predict(state)):
      getattr(compiled, "trace", compiled.lower)(state, chunk)
    self._traced = True

  def evaluate(self, state, batches: Iterable[Batch]) -> dict[str, float]:
    """Eval metrics over all `batches`, of any size.

    Raises:
      ValueError: `batches` is empty.
    """
    return metrics_lib.scalars(self.strategy.metrics_to_host(self._eval_outputs(state,
                                                                                 batches)))

  def evaluate_members(self, state, batches: Iterable[Batch]) -> list[dict[str, float]]:
    """Each ensemble member's own eval metrics (a sweep's results), one dict per member.

    A member's `member_*` metrics are its own; they are returned without the
    prefix (`accuracy`), and the ensemble-wide ones are left out.

    Raises:
      ValueError: `batches` is empty.
    """
    host = self.strategy.fetch_metrics(self._eval_outputs(state, batches))
    merged = functools.reduce(lambda a, b: a.merge(b), host)  # Over calls, not members.
    results = []
    for i in range(np.shape(jax.tree.leaves(merged)[0])[0]):
      scalars = metrics_lib.scalars(jax.tree.map(lambda x, i=i: x[i], merged))
      own = {k.removeprefix("member_"): v for k, v in scalars.items()
             if k.startswith("member_")}
      results.append(own or scalars)
    return results

  def one_set(self, eval_batches: Callable[[], Iterable[Batch]]
              ) -> Callable[[], Iterable[Batch]]:
    """`eval_batches` known as one eval set: a second evaluation of the same state on it
    (a sweep's per-member report right after `Evaluate`'s ensemble metrics) reuses the
    first one's eval-step outputs instead of running the eval step over every batch again.

    Each call still gives a fresh iterable; `eval_batches()` is called only when one is
    iterated. The outputs kept are the last pass's per-chunk metrics, held until the next
    pass; the state is held weakly.
    """
    def batches() -> Iterable[Batch]:
      return _SetBatches(eval_batches, source=batches)
    return batches

  def _eval_outputs(self, state, batches: Iterable[Batch]) -> list:
    source = getattr(batches, "source", None)
    if source is not None and self._last_pass is not None:
      last_source, last_state, outputs = self._last_pass
      if last_source is source and last_state() is state:
        return outputs
    outputs = self._run_eval(state, batches)
    if source is not None:
      try:
        self._last_pass = (source, weakref.ref(state), outputs)
      except TypeError:  # A state that cannot be referenced weakly is evaluated each time.
        self._last_pass = None
    return outputs

  def _run_eval(self, state, batches: Iterable[Batch]) -> list:
    step_fn = self.compiled.eval(state)
    outputs = []
    for batch in batches:
      for chunk, _ in self.chunks(batch):
        outputs.append(step_fn(state, self._put(chunk)))
        wait_for_previous_call(outputs)
    if not outputs:
      raise ValueError("evaluate() got no eval batches (an empty iterable).")
    self._raise_host_error(outputs)
    return outputs

  def _raise_host_error(self, outputs: list) -> None:
    """Raises the first error of a host function the eval or predict step called
    (`CompiledSteps.host_calls`), once the last call, and so every earlier one, is done."""
    if outputs:
      jax.block_until_ready(outputs[-1])
      self.compiled.host_calls.raise_if_failed()

  def predict(self, state, batch: Batch) -> np.ndarray:
    """Host predictions for a batch of any size (ensemble means for ensembles)."""
    step_fn = self.compiled.predict(state)
    outputs, sizes = [], []
    for chunk, real in self.chunks(dict(batch)):
      outputs.append(step_fn(state, self._put(chunk)))
      sizes.append(real)
      wait_for_previous_call(outputs)
    self._raise_host_error(outputs)
    parts = [jax.tree.map(lambda x, n=real: x[:n], self.strategy.outputs_to_host(out))
             for out, real in zip(outputs, sizes, strict=True)]
    return jax.tree.map(lambda *xs: np.concatenate(xs), *parts)


class _SetBatches:
  """A fresh iterable of an eval set's batches (`Evaluator.one_set`), naming its set."""

  def __init__(self, eval_batches: Callable[[], Iterable[Batch]], source: Callable):
    self._eval_batches, self.source = eval_batches, source

  def __iter__(self) -> Iterator[Batch]:
    return iter(self._eval_batches())
