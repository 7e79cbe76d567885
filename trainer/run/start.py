"""Where a run starts: the latest checkpoint in its directory (resume, no flag needed), a
state it was given, or a new one; and its train data from that step.

Resume is one call: the train state, the data position (a checkpointable
iterator such as Grain's is set to it before it reads a batch, so a resume costs
the same at any step) and the actions' state, all from the latest complete
checkpoint.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from strategies import Strategy
from trainer.checkpoint import Checkpointer, CheckpointError, CorruptCheckpointError
from trainer.checkpoint.run_state import run_shape
from trainer.data.device import DeviceData
from trainer.data.feed import check_resumable, describe_shape, is_checkpointable
from trainer.distributed.agree import per_process
from trainer.loop.actions import Action
from trainer.run.state import States

Batch = Mapping[str, Any]
PyTree = Any
#: What `fit` takes as train data. `start_step -> iterable of host batches`, where batch i
#: is the batch for step `start_step + i` (needed to resume); or an iterable consumed one
#: batch per step from the state's current step. Each batch holds this process's rows
#: (`strategy.process_slice(batch_size)`: all of them on one process). An iterator with
#: `get_state`/`set_state` (Grain's) has its position saved with each checkpoint and
#: restored on resume. Or a `trainer.data.DeviceData` (`config.data.pipeline = "device"`):
#: the split is placed on the devices and each step gathers its batch in the compiled
#: call; its position is the step.
TrainData = Callable[[int], Iterable[Batch]] | Iterable[Batch] | DeviceData


@dataclasses.dataclass(frozen=True)
class Start:
  """Where a run starts.

  Attributes:
    state: the placed train state at `step`.
    step: the step the run starts at.
    batch: the batch of that step (for a device dataset: an example of its shapes).
    batches: the host batches after `batch`, or None for a device dataset.
    device_data: the device-resident dataset, or None for host batches.
  """

  state: PyTree
  step: int
  batch: Batch
  batches: Iterator[Batch] | None
  device_data: DeviceData | None


def step_of(state: PyTree, strategy: Strategy) -> int:
  """The host value of a placed state's step (all members step together)."""
  return int(np.ravel(strategy.to_canonical(state.step))[0])


def start(train_batches: TrainData, *, state: PyTree | None, checkpointer: Checkpointer | None,
          actions: Sequence[Action], states: States, strategy: Strategy, batch_size: int,
          check_batch: Callable[[Batch, int], None]) -> Start:
  """Resumes from `checkpointer`'s latest checkpoint when `state` is None and there is one;
  else starts from `state`, or from a new state made for the first batch.

  Raises:
    ValueError: resuming needs `train_batches` as `start_step -> batches`, or the
      first batch does not fit (`check_batch`).
    CheckpointError: the checkpoint belongs to another model, or is unreadable and
      `checkpointer.on_corrupt` is 'error' (under 'fallback' an unreadable latest
      checkpoint is set aside and the newest readable one resumed).
  """
  resume_step = checkpointer.latest_step() if checkpointer and state is None else None
  while True:  # Once, or again from an earlier step when the latest one is unreadable.
    step = resume_step or (step_of(state, strategy) if state is not None else 0)
    device_data = train_batches if isinstance(train_batches, DeviceData) else None
    if device_data is not None:
      batches = None
      batch = device_data.example_batch(strategy.process_slice(batch_size))
    else:
      batches = _train_iterator(train_batches, step, resume_step, checkpointer)
      # A checkpointable iterator that resumes is set to the saved position before its first
      # read (`_resume`): a stream read from its start (a text corpus) would read its way
      # through every step already trained to reach `step`.
      batch = None if resume_step and is_checkpointable(batches) else next(batches)
    if batch is not None:
      check_batch(batch, step)
    if not resume_step:
      break
    resumed = _resume_or_set_aside(states, checkpointer, resume_step, batches, batch, actions,
                                   check_batch)
    if resumed is not None:
      state, batch = resumed
      break
    resume_step = checkpointer.latest_step()
  if state is None:
    state = states.init(batch)
  return Start(state, step, batch, batches, device_data)


def _resume_or_set_aside(states: States, checkpointer: Checkpointer, step: int,
                         batches: Iterator[Batch] | None, batch: Batch | None,
                         actions: Sequence[Action],
                         check_batch: Callable[[Batch, int], None]
                         ) -> tuple[PyTree, Batch] | None:
  """`_resume`, or None where checkpoint `step` is unreadable on any process and
  `config.checkpoint.on_corrupt='fallback'` set it aside (the caller tries the next)."""
  error = None
  try:
    resumed = _resume(states, checkpointer, step, batches, batch, actions, check_batch)
  except CheckpointError as e:
    error = e
  error = read_everywhere(error)
  if error is None:
    return resumed
  if not isinstance(error, CorruptCheckpointError) or checkpointer.on_corrupt != "fallback":
    raise error
  checkpointer.set_aside(step, error)
  if checkpointer.latest_step() is None:
    logging.error("No readable checkpoint is left in %s: starting from step 0.",
                  checkpointer.directory)
  return None


def read_everywhere(error: CheckpointError | None) -> CheckpointError | None:
  """This process's read error, or, where another process failed to read the checkpoint
  (a file only it reads), one saying so: every process then falls back to the same step.
  One process: `error` itself."""
  failed = per_process(error is not None)
  if error is None and failed.any():
    return CorruptCheckpointError(f"processes {np.flatnonzero(failed).tolist()} could not read "
                                  f"the checkpoint")
  return error


def _train_iterator(train_batches: Any, start: int, resume_step: int | None,
                    checkpointer: Checkpointer | None) -> Iterator[Batch]:
  if callable(train_batches):
    return iter(train_batches(start))
  if resume_step:
    raise ValueError(
        f"resuming from checkpoint step {resume_step} in {checkpointer.directory} needs "
        f"train_batches as a function start_step -> batches, so the data order continues "
        f"where the checkpoint left it.")
  return iter(train_batches)


def _resume(states: States, checkpointer: Checkpointer, step: int,
            batches: Iterator[Batch] | None, batch: Batch | None,
            actions: Sequence[Action],
            check_batch: Callable[[Batch, int], None]) -> tuple[PyTree, Batch]:
  """Restores the run saved at `step` in one call: the state, the data position and the
  actions' state. `batch` is None for a checkpointable iterator not read yet: it is set to
  the checkpoint's position (when it holds one) and step `step`'s batch read from there."""
  where, shape = checkpointer.step_dir(step), run_shape(states.strategy)
  if batch is None:
    layout = checkpointer.layout(step)
    data = layout.get("data")
    if data is not None:
      check_resumable(data, dict(layout.get("shape") or {}), shape, where)
      batches.set_state(data)
    batch = next(batches)
    check_batch(batch, step)
  run = states.restore(checkpointer, batch, step=step)
  for action in actions:
    if action.name in run.actions:
      action.load_state_dict(run.actions[action.name])
  if run.shape and run.shape != shape:  # Another machine shape: elastic resume.
    logging.info("Checkpoint step %d was saved by %s; resuming on %s.", step,
                 describe_shape(run.shape), describe_shape(shape))
  logging.info("Resuming at step %d from %s", step, where)
  return run.state, batch
