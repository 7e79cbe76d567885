"""Each sweep member's own train metrics: `train/<label>/<metric>`.

A sweep trains as one ensemble program, and the run's `train/<metric>` is the members'
mean. `MemberTrainMetrics` writes, every `log_every_steps`, each member's train `loss` and
the sweep's metric (`config.sweep.metric`, where the train metrics hold it: an RL sweep's
`reward`, a DPO sweep's `rewards/accuracies`) under the member's label, as `SweepReport`
writes each member's eval metrics under `eval/<label>/`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax

from strategies.tree import split_steps
from trainer import metrics as metrics_lib
from trainer.loop.actions import Action, StepView


class MemberTrainMetrics(Action):
  """Writes each member's train `names` (those the train metrics hold) every `every_steps`,
  averaged over the steps since the last write.

  Args:
    writer: where `train/<label>/<name>` scalars go.
    fetch_metrics: the strategy's (host trees with a leading member axis).
    labels: `() -> [label of member i]` (None: an empty slot).
    names: the metrics to write per member.
  """

  def __init__(self, writer, *, fetch_metrics: Callable[[list], list],
               labels: Callable[[], Sequence[str | None]], names: Sequence[str],
               every_steps: int):
    super().__init__(every_steps=every_steps)
    self.writer, self.fetch_metrics, self.labels = writer, fetch_metrics, labels
    self.names = tuple(dict.fromkeys(names))
    self._pending: list[tuple[int | None, Any]] = []
    self._labels: list[str | None] = []  # The slots' labels at the latest step.

  def triggers(self, view: StepView) -> bool:
    return True  # Collects every call's metrics; writes every `every_steps`.

  def next_boundary(self, step: int) -> None:
    return None  # A call's outputs hold each of its steps' metrics.

  def run(self, view: StepView) -> None:
    self._pending.append((view.steps_axis, view.outputs["metrics"]))
    self._labels = list(self.labels())  # Before the sweep's report may end a slot's trial.
    if view.crossed(self.every_steps):
      self._write(view.step)

  def end(self, view: StepView) -> None:
    if self._pending:
      self._write(view.step)

  def _write(self, step: int) -> None:
    fetched = self.fetch_metrics([m for _, m in self._pending])
    steps = []
    for (axis, _), host in zip(self._pending, fetched, strict=True):
      steps.extend([host] if axis is None else split_steps(host, axis))
    self._pending = []
    merged = functools.reduce(lambda a, b: a.merge(b), steps)  # Over steps: [members, ...].
    scalars = {}
    for i, label in enumerate(self._labels):
      if label is None:
        continue
      values = metrics_lib.scalars(jax.tree.map(lambda x, i=i: x[i], merged))
      scalars.update({f"train/{label}/{n}": values[n] for n in self.names if n in values})
    if scalars:
      self.writer.write_scalars(step, scalars)
