"""The corpus's Grain worker processes (`config.data.workers`): started and stopped.

`start` runs a lane group in worker processes (`grain.IterDataset.mp_prefetch`) and
returns its blocks and the function that stops the workers, which also runs when the
iterator that owns them goes or the interpreter exits. Each worker leaves Ctrl-C to the
training process and ends when that process ends, however it ends (`_worker_init`).
"""

from __future__ import annotations

import functools
import os
import weakref
from typing import Any

import grain

#: Arrays up to this size pass from a worker through its queue (a pipe); larger ones, a
#: block's token rows, through shared memory, which `close` unlinks. A block sent through the
#: pipe whole would be larger than the pipe holds at 128 tokens a row or more: the worker's
#: writer thread then could not finish before the training process read it, the worker
#: could not exit when told to, and every `close` waited Grain's 25 s before killing it.
_QUEUE_BYTES = 1 << 10
#: How often a worker checks that the training process is still there.
_PARENT_POLL_SECONDS = 0.5


def start(dataset: grain.IterDataset, owner: Any, *, workers: int, buffer: int):
  """`(blocks, stop)`: `dataset`'s elements made in `workers` worker processes, each
  keeping `buffer` ready; `stop()` ends the workers, and runs by itself when `owner` is
  collected or, at the latest, as the interpreter starts to exit (later, Grain's own
  cleanup would find its modules half torn down)."""
  from absl import flags
  if not flags.FLAGS.is_parsed():  # Grain's worker start reads its absl flags: unparsed
    flags.FLAGS.mark_as_parsed()  # (a notebook, a test), they hold their defaults.
  options = grain.experimental.DatasetOptions(min_shm_size=_QUEUE_BYTES)
  blocks = iter(grain.experimental.WithOptionsIterDataset(dataset, options).mp_prefetch(
      grain.MultiprocessingOptions(num_workers=workers, per_worker_buffer_size=buffer),
      worker_init_fn=functools.partial(_worker_init, os.getpid())))
  held = [blocks]
  return _Held(held), weakref.finalize(owner, _stop_workers, held)


class _Held:
  """The workers' iterator, through the list `_stop_workers` empties."""

  def __init__(self, held: list):
    self._held = held

  def __next__(self):
    return next(self._held[0])


def _stop_workers(held: list) -> None:
  if held:
    held.pop().close()


def _worker_init(parent: int, worker: int, workers: int) -> None:
  """In a worker process, first: Ctrl-C is left to the training process, and the worker
  ends when that process ends, however it ends.

  A terminal's Ctrl-C reaches every process of its group: the training process stops at
  a step boundary and closes the workers, which must not die of it on their own first
  (half-way through writing a block, which `close` would then wait for). A killed
  training process (SIGKILL, the OOM killer) runs no cleanup, and its workers would wait
  on their full queues for ever, holding the pipes its launcher reads: a daemon thread
  checks the parent twice a second. (Linux's PR_SET_PDEATHSIG would fire when the
  *thread* that started the worker ends, and Grain starts its workers from a prefetch
  thread that ends at `close`: the worker was then killed mid-block, a block of rows
  longer than a pipe holds, and `close` waited for the rest of it for ever.)"""
  del worker, workers
  import signal
  import threading
  import time
  signal.signal(signal.SIGINT, signal.SIG_IGN)

  def watch():
    while os.getppid() == parent:
      time.sleep(_PARENT_POLL_SECONDS)
    os._exit(1)

  threading.Thread(target=watch, name="die-with-parent", daemon=True).start()
