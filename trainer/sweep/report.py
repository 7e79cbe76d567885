"""What a sweep reports and leaves behind: each member's eval metrics under its label, the
best member, a summary (a table in the log, `sweep.json`, `sweep.png`) and the best member
exported as a single-model checkpoint.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import ml_collections
import numpy as np

from trainer.loop.actions import Action, Produced, StepView
from trainer.step.optim import create_schedule, optimizer_for
from trainer.sweep.members import Sweep
from trainer.sweep.optimizer import single_model_opt_state

if TYPE_CHECKING:  # Only annotations: clu's writers import TensorFlow (seconds).
  from clu import metric_writers

Batch = Mapping[str, Any]
PyTree = Any


class SweepReport(Action):
  """A sweep's results: each member's eval metrics under its label, the best member, a
  summary at the end (a table in the log, `sweep.json`), and the best member exported.

  Args:
    writer: where `eval/<label>/<metric>` scalars go.
    evaluate_members: `(state, batches) -> [results of member i]`.
    eval_batches: returns a fresh iterable of eval batches per evaluation.
    labels: each member's label (`Sweep.label`).
    every_steps: the evaluation schedule (and the last step).
    metric, mode: what "best" means (`config.sweep.metric`/`mode`; "" takes the
      first metric).
    summarize: `(state, step, results, best index) -> None`: writes the summary files
      and exports the best member (`summarize`).
  """

  time_category = "eval"

  reads_state = True

  def __init__(self, writer: metric_writers.MetricWriter,
               evaluate_members: Callable[[Any, Iterable[Batch]], list[dict[str, float]]],
               eval_batches: Callable[[], Iterable[Batch]], *, labels: list[str],
               every_steps: int, metric: str, mode: str,
               summarize: Callable[[Any, int, list[dict[str, float]], int], None]):
    if mode not in ("min", "max"):
      raise ValueError(f"config.sweep.mode={mode!r} must be 'min' or 'max'.")
    super().__init__(every_steps=every_steps)
    self.writer, self.evaluate_members, self.eval_batches = writer, evaluate_members, eval_batches
    self.labels, self.metric, self.mode, self.summarize = labels, metric, mode, summarize
    self.results: list[dict[str, float]] | None = None
    self._last: int | None = None

  def triggers(self, view: StepView) -> bool:
    return super().triggers(view) and not view.preempted

  def run(self, view: StepView) -> Produced:
    start = time.perf_counter()
    self.results = self.evaluate_members(view.state, self.eval_batches())
    self.writer.write_scalars(view.step, {f"eval/{label}/{k}": v for label, r in
                                          zip(self.labels, self.results, strict=True)
                                          for k, v in r.items()})
    self._last = view.step
    best = self.best()
    return Produced(eval_seconds=time.perf_counter() - start,
                    best=(view.step, self.results[best][self.metric_name()]))

  def metric_name(self) -> str:
    if self.metric and self.metric not in self.results[0]:
      raise ValueError(f"config.sweep.metric={self.metric!r} is not a member's eval metric; "
                       f"they are {sorted(self.results[0])}.")
    return self.metric or next(iter(self.results[0]))

  def best(self) -> int:
    """The index of the best member by the last evaluation."""
    values = np.asarray([r[self.metric_name()] for r in self.results], dtype=float)
    bad = -np.inf if self.mode == "max" else np.inf
    values = np.where(np.isnan(values), bad, values)
    return int(np.argmax(values) if self.mode == "max" else np.argmin(values))

  def end(self, view: StepView) -> Produced | None:
    if view.preempted:
      return None
    produced = None
    if self._last != view.step and view.step > view.start_step:
      produced = self.run(view)
    if self.results is not None:
      self.summarize(view.state, view.step, self.results, self.best())
    return produced


def summary_rows(sweep: Sweep, results: Sequence[Mapping[str, float]]) -> list[dict[str, Any]]:
  """One row per member: its label, swept values and results."""
  return [{"member": i, "label": sweep.label(i),
           **{n: sweep.members[i][n] for n in sweep.varied}, **dict(r)}
          for i, r in enumerate(results)]


def format_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> str:
  """A plain-text table of `rows` (one line each) under `columns`."""
  cells = [[str(c) for c in columns]] + [
      [f"{r[c]:.4f}" if isinstance(r[c], float) else str(r[c]) for c in columns] for r in rows]
  widths = [max(len(row[j]) for row in cells) for j in range(len(columns))]
  return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True))
                   for row in cells)


def plot(rows: Sequence[Mapping[str, Any]], varied: Sequence[str], metric: str, best: int,
         path: str) -> None:
  """Saves a PNG of `metric` against each swept hyperparameter (one panel each; one colour
  per seed; the best member ringed)."""
  import matplotlib
  matplotlib.use("Agg")  # Files only: no display.
  from matplotlib import pyplot as plt

  names = [n for n in varied if n != "seed"] or ["seed"]
  fig, axes = plt.subplots(1, len(names), figsize=(4 * len(names), 3.2), squeeze=False)
  seeds = sorted({r.get("seed", 0) for r in rows})
  for ax, name in zip(axes[0], names, strict=True):
    for seed in seeds:
      mine = [r for r in rows if r.get("seed", 0) == seed]
      ax.scatter([r[name] for r in mine], [r[metric] for r in mine], label=f"seed {seed}")
    ax.scatter([rows[best][name]], [rows[best][metric]], s=160, facecolors="none",
               edgecolors="black", label="best")
    values = [r[name] for r in rows]
    if min(values) > 0 and max(values) >= 10 * min(values):
      ax.set_xscale("log")
    ax.set_xlabel(name)
    ax.set_ylabel(metric)
  axes[0][0].legend(fontsize="small")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)



def export_member(state: PyTree, member: int, directory: str, *, sweep: Sweep,
                  config: ml_collections.ConfigDict, strategy: Any,
                  num_train_steps: int | None,
                  labels: Callable[[PyTree], PyTree] | None = None) -> None:
  """Writes sweep member `member` of `state` as a single-model checkpoint in `directory`.

  It restores under any single-model strategy built from
  `sweep.member_config(config, member)`, and a run there resumes from it: its
  optimizer state is converted to the layout of that config's optimizer
  (`trainer.step.optim.optimizer_for`, grouped by `labels` when given, with a
  schedule over `num_train_steps`).
  """
  from strategies.single_device import SingleDevice
  from trainer.checkpoint import Checkpointer, RunState, save_run
  one = jax.tree.map(lambda x: x[member], strategy.to_canonical(state))
  member_config = sweep.member_config(config, member)
  plain = optimizer_for(member_config, create_schedule(member_config, num_train_steps),
                        labels=labels)
  one = one.replace(opt_state=single_model_opt_state(one.opt_state, plain.init(one.params)))
  if getattr(one, "ema_decay", None) is not None:  # A fixed decay there: from its config.
    one = one.replace(ema_decay=None)
  single = SingleDevice()
  checkpointer = Checkpointer(directory, every_steps=0, async_save=False)
  try:
    save_run(checkpointer, single, RunState(jax.device_put(one, single.device), int(one.step)))
    checkpointer.wait()
  finally:
    checkpointer.close()
  logging.info("Sweep member %d (%s) exported to %s", member, sweep.label(member), directory)


def summarize(state: PyTree, step: int, results: list[dict[str, float]], best: int, *,
              sweep: Sweep, config: ml_collections.ConfigDict, workdir: str | None,
              export: Callable[[PyTree, int, str], None]) -> None:
  """A sweep's summary: a table in the log; with a `workdir`, `sweep.json`, `sweep.png`
  (the metric against each swept hyperparameter) and the best member as a single-model
  checkpoint in `<workdir>/sweep_best` (`export`; its config beside it,
  `sweep_best_config.json`)."""
  rows = summary_rows(sweep, results)
  names = list(results[0])
  logging.info("Sweep at step %d, best member %d (%s):\n%s", step, best, sweep.label(best),
               format_table(rows, ["label", *names]))
  if not workdir or jax.process_index() > 0:
    return
  os.makedirs(workdir, exist_ok=True)
  metric = config.sweep.metric or names[0]
  with open(os.path.join(workdir, "sweep.json"), "w") as f:
    json.dump({"step": step, "metric": metric, "mode": config.sweep.mode,
               "best": rows[best], "members": rows}, f, indent=1)
  plot(rows, sweep.varied, metric, best, os.path.join(workdir, "sweep.png"))
  export(state, best, os.path.join(workdir, "sweep_best"))
  with open(os.path.join(workdir, "sweep_best_config.json"), "w") as f:
    f.write(sweep.member_config(config, best).to_json(indent=1))


def actions(sweep: Sweep, config: ml_collections.ConfigDict, *, strategy: Any,
            writer: metric_writers.MetricWriter,
            evaluate_members: Callable[[Any, Iterable[Batch]], list[dict[str, float]]],
            eval_batches: Callable[[], Iterable[Batch]], workdir: str | None,
            num_train_steps: int | None,
            labels: Callable[[PyTree], PyTree] | None = None) -> list[Action]:
  """The sweep's actions for a run: its `SweepReport`, which evaluates every member at each
  evaluation and summarizes the sweep at the end (`summarize`, `export_member`).

  Args:
    strategy: the ensemble strategy that holds the members.
    writer: where each member's `eval/<label>/<metric>` goes.
    evaluate_members: `(state, batches) -> [results of member i]`
      (`trainer.evaluation.Evaluator.evaluate_members`).
    eval_batches: returns a fresh iterable of eval batches per evaluation.
    workdir: where the summary files and the best member go (None: the log only).
    num_train_steps, labels: how the exported member's optimizer is built
      (`export_member`).
  """
  export = functools.partial(export_member, sweep=sweep, config=config, strategy=strategy,
                             num_train_steps=num_train_steps, labels=labels)
  return [SweepReport(writer, evaluate_members, eval_batches,
                      labels=[sweep.label(i) for i in range(len(sweep))],
                      every_steps=config.eval_every_steps, metric=config.sweep.metric,
                      mode=config.sweep.mode,
                      summarize=functools.partial(summarize, sweep=sweep, config=config,
                                                  workdir=workdir, export=export))]
