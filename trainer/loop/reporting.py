"""The loop's reports of training: `ReportMetrics` writes the train scalars (loss,
throughput, what the config asks for) every `log_every_steps`, and `ReportSpikes` the
updates left out as loss spikes (`config.spikes.skip`). Built by
`trainer.loop.builtin.from_config`, which re-exports both.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from strategies.tree import split_steps
from trainer import metrics as metrics_lib
from trainer.loop import timing
from trainer.loop.actions import Action, StepView

if TYPE_CHECKING:  # Only annotations: clu's writers import TensorFlow (seconds).
  from clu import metric_writers

Batch = Mapping[str, Any]
PyTree = Any


class ReportMetrics(Action):
  """Writes the mean train metrics, the learning rate, throughput and where the time went
  every `every_steps`.

  Step metrics stay on device until a write; then they come to the host in
  one transfer and merge in numpy. A call of several steps holds each step's
  metrics (`steps_axis`): they are split on the host, so every `every_steps`
  boundary inside a call gets exactly its own steps' metrics.

  Args:
    writer: where scalars go.
    fetch_metrics: the strategy's transfer of several calls' metrics to the host.
    merge_host_metrics: the strategy's merge of host metrics into one collection.
    learning_rate: `step -> rate` of the update from `step`, or None if unknown.
    batch_size: examples per step, for examples/s.
    counts_skipped: whether to report `train/skipped_steps` (`nonfinite='skip'`).
    flops: `() -> StepFlops` of the train step (`trainer.throughput`): with one,
      `train/tflops_per_device` is written. Default: the run's (`StepView.flops`).
    peak_tflops: `() -> the device's peak TFLOP/s, or None`: with a peak, `train/mfu`.
    tokens_per_step: `() -> tokens in a batch, or None` (language models), for
      `train/tokens_per_sec`. Default: the run's (`StepView.tokens_per_step`).
    flops_figures: whether to write `train/tflops_per_device` and `train/mfu` at all
      (the built-in actions: on an accelerator, `trainer.throughput.reports_flops`).

  Time: `clock` (`trainer.loop.timing.LoopClock`) is the one the loop measures
  with; each write adds `train/time_<category>` (fractions of the wall time so
  far) and `train/goodput` (the `train` fraction), and the split is logged when
  the loop ends. The time before the loop counts as `startup`, or `restart` for
  a run that resumed. The totals are saved with each checkpoint and added to on
  resume, so they cover every attempt of the run.
  """

  time_category = "train"

  def __init__(self, writer: metric_writers.MetricWriter, *, every_steps: int,
               fetch_metrics: Callable[[list], list],
               merge_host_metrics: Callable[[list], Any],
               learning_rate: Callable[[int], float | None], batch_size: int,
               counts_skipped: bool = False, flops: Callable[[], Any] | None = None,
               peak_tflops: Callable[[], float | None] | None = None,
               tokens_per_step: Callable[[], int | None] | None = None,
               flops_figures: bool = True):
    super().__init__(every_steps=every_steps)
    self.flops, self.peak_tflops, self.tokens_per_step = flops, peak_tflops, tokens_per_step
    self.flops_figures = flops_figures
    self.clock = timing.LoopClock()
    self.writer = writer
    self.fetch_metrics, self.merge_host_metrics = fetch_metrics, merge_host_metrics
    self.learning_rate, self.batch_size = learning_rate, batch_size
    self.counts_skipped = counts_skipped
    self._pending: list[tuple[int, int | None, PyTree]] = []  # (first step, steps axis, device)
    self._host: list[tuple[int, PyTree]] = []  # (step, host metrics of that step)
    self._tick = self._eval_seconds = 0.0
    self._last_step = 0

  def triggers(self, view: StepView) -> bool:
    return True  # Collects every call's metrics; writes every `every_steps`.

  def next_boundary(self, step: int) -> None:
    return None  # A call's outputs hold each of its steps' metrics.

  def needs_checked_step(self, view: StepView) -> bool:
    # A write reports `skipped_steps`, which must count this step.
    return self.counts_skipped and bool(view.crossed(self.every_steps))

  def begin(self, view: StepView) -> None:
    self._tick, self._eval_seconds = time.perf_counter(), view.eval_seconds
    self._last_step = view.step
    self.clock.add("restart" if view.start_step else "startup", timing.startup_seconds())

  def run(self, view: StepView) -> None:
    self._pending.append((view.previous_step + 1, view.steps_axis, view.outputs["metrics"]))
    crossed = view.crossed(self.every_steps)
    if crossed:
      self._write(view, crossed)

  def end(self, view: StepView) -> None:
    if self._pending or self._host:
      self._write(view, [view.step])

  def close(self) -> None:
    logging.info("Time: %s", self.clock.describe())
    timing.mark_loop_end()

  def state_dict(self) -> dict[str, float]:
    return self.clock.state_dict()

  def load_state_dict(self, state: dict[str, float]) -> None:
    self.clock.load_state_dict(state)

  def _to_host(self) -> None:
    """The pending calls' metrics to the host in one transfer, one entry per step."""
    if not self._pending:
      return
    fetched = self.fetch_metrics([m for _, _, m in self._pending])
    for (first, steps_axis, _), host in zip(self._pending, fetched, strict=True):
      if steps_axis is None:
        self._host.append((first, host))
      else:
        self._host.extend(enumerate(split_steps(host, steps_axis), start=first))
    self._pending = []

  def _write(self, view: StepView, steps: list[int]) -> None:
    self._to_host()
    # One rate for the steps since the last write; boundaries inside one call share it.
    seconds = (time.perf_counter() - self._tick) - (view.eval_seconds - self._eval_seconds)
    steps_per_sec = (view.step - self._last_step) / max(seconds, 1e-9)
    examples_per_sec = steps_per_sec * self.batch_size
    eta = (view.num_steps - view.step) / max(steps_per_sec, 1e-9)
    throughput = self._throughput(view, steps_per_sec)
    fractions = self.clock.fractions()
    time_split = {f"train/time_{k}": v for k, v in fractions.items()}
    time_split["train/goodput"] = fractions["train"]
    losses = []
    for step in steps:
      ready = [m for s, m in self._host if s <= step]
      self._host = [(s, m) for s, m in self._host if s > step]
      if not ready:
        continue
      merged = self.merge_host_metrics(ready)
      scalars = {f"train/{k}": v for k, v in metrics_lib.scalars(merged).items()}
      lr = self.learning_rate(step - 1)  # The rate of this step's update.
      if lr is not None:
        scalars["train/learning_rate"] = lr
      scalars.update({"train/steps_per_sec": steps_per_sec,
                      "train/examples_per_sec": examples_per_sec, **throughput, **time_split})
      if self.counts_skipped:
        scalars["train/skipped_steps"] = sum(1 for s in view.skipped_at if s <= step)
      self.writer.write_scalars(step, scalars)
      losses.append(scalars.get("train/loss"))
    # The console's line: the loss, the rate and the ETA; every scalar goes to the writers
    # (the console writer leaves out the `train/` ones this line stands for).
    loss = f"loss {losses[-1]:.4g}, " if losses and losses[-1] is not None else ""
    logging.info("step %d/%d: %s%.2f steps/s, ETA %dm%02ds", view.step, view.num_steps, loss,
                 steps_per_sec, eta // 60, eta % 60)
    self._tick, self._eval_seconds = time.perf_counter(), view.eval_seconds
    self._last_step = view.step

  def _throughput(self, view: StepView, steps_per_sec: float) -> dict[str, float]:
    """`train/tokens_per_sec`, `train/tflops_per_device` and `train/mfu`, as far as known."""
    out = {}
    tokens = self.tokens_per_step() if self.tokens_per_step else view.tokens_per_step
    if tokens:
      out["train/tokens_per_sec"] = steps_per_sec * tokens
    if not self.flops_figures:
      return out
    flops = self.flops() if self.flops else view.flops
    if flops is not None and flops.per_device is not None:
      achieved = flops.per_device * steps_per_sec / 1e12
      out["train/tflops_per_device"] = achieved
      peak = self.peak_tflops() if self.peak_tflops else None
      if peak:
        out["train/mfu"] = achieved / peak
    return out


class ReportSpikes(Action):
  """Writes `train/spike_skips` (over all members) every `every_steps` and at the end, and
  logs the updates left out as loss spikes since the last write (`trainer.step.spikes`),
  with the members that skipped them.

  Args:
    writer: where the scalar goes.
    to_host: the strategy's `to_canonical` (a count per member for an ensemble).
  """

  def __init__(self, writer: metric_writers.MetricWriter, *, every_steps: int,
               to_host: Callable[[Any], Any]):
    super().__init__(every_steps=every_steps)
    self.writer, self.to_host = writer, to_host
    self._seen, self._since = None, 0

  def _skips(self, view: StepView):
    return np.atleast_1d(np.asarray(self.to_host(view.state.spikes.skips)))

  def begin(self, view: StepView) -> None:
    self._seen, self._since = self._skips(view), view.step

  def triggers(self, view: StepView) -> bool:
    return bool(view.crossed(self.every_steps)) or view.is_last

  def next_boundary(self, step: int) -> None:
    return None  # The count is cumulative: any step after a boundary reports it.

  def run(self, view: StepView) -> None:
    skips = self._skips(view)
    grew = np.flatnonzero(skips > self._seen)
    if grew.size:
      who = f" (members {grew.tolist()})" if skips.size > 1 else ""
      logging.warning("Loss spikes: %d update(s) left out between steps %d and %d%s; %d so "
                      "far", int((skips - self._seen).sum()), self._since, view.step, who,
                      int(skips.sum()))
    self._seen, self._since = skips, view.step
    self.writer.write_scalars(view.step, {"train/spike_skips": int(skips.sum())})
