"""The run's compiled calls: `advance(state, step)` for the loop (`trainer.loop.driver`).

With host batches, each call's batches are read, checked and placed ahead of
it (`trainer.data.feed.DeviceFeed`), one step a call or a chunk of the plan's
steps stacked into one call. With a device-resident dataset the host only
dispatches each call, which gathers its own batches on the devices.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from strategies import Strategy
from trainer.data.device import DeviceData, DeviceSource
from trainer.data.feed import DeviceFeed, is_checkpointable
from trainer.loop import driver
from trainer.loop.chunks import ChunkPlan
from trainer.loop.timing import LoopClock
from trainer.step.functions import CompiledSteps

Batch = Mapping[str, Any]
PyTree = Any


def host_batch_calls(compiled: CompiledSteps, strategy: Strategy, state: PyTree,
                     batches: Iterator[Batch], *, start: int, num_steps: int,
                     plan: ChunkPlan | None, prefetch: int, source: Any,
                     check: Callable[[Batch, int], None], clock: LoopClock) -> driver.Advance:
  """`advance` for host batches (the first is step `start`'s): each call's batches checked
  and placed `prefetch` calls ahead of it; one step a call, or `plan`'s chunks stacked
  into one call. `source`: the data iterator, whose position each call reports when it
  has one (`get_state`)."""
  feed = DeviceFeed(batches, start, check=check,
                    put=strategy.put_batches if plan else strategy.put_batch,
                    ahead=prefetch, stop_step=num_steps,
                    state_of=source.get_state if is_checkpointable(source) else None,
                    sizes=plan.size if plan else None)
  call = compiled.train_chunk(state) if plan else compiled.train(state)

  def advance(state, step):
    with clock.measure("data"):
      placed, data_state = feed.next()
    state, outputs = call(state, placed, None) if plan else call(state, placed)
    with clock.measure("data"):
      feed.fill()  # The next batches are read and placed while this call runs.
    return state, outputs, step + feed.last_steps, data_state

  return advance


def device_data_calls(compiled: CompiledSteps, strategy: Strategy, state: PyTree,
                      data: DeviceData, *, plan: ChunkPlan) -> driver.Advance:
  """`advance` for a device-resident dataset: the host only dispatches each call."""
  source = DeviceSource(data, strategy, plan.steps_per_call)
  calls = {n: compiled.train_chunk(state, data=data, num_steps=n) for n in plan.sizes}
  logging.info("Train data on the devices: %d examples, %.1f MB per device",
               data.num_examples, data.nbytes / 2**20)

  def advance(state, step):
    n = plan.size(step)
    call = calls.get(n) or compiled.train_chunk(state, data=data, num_steps=n)
    state, outputs = call(state, None, source.inputs(step))
    return state, outputs, step + n, None

  return advance


def compiles_at(plan: ChunkPlan | None) -> Callable[[int], bool]:
  """`step -> whether the call from step compiles`: the first call of each length."""
  seen: set[int] = set()

  def compiles(step: int) -> bool:
    size = plan.size(step) if plan else 1
    new = size not in seen
    seen.add(size)
    return new

  return compiles
