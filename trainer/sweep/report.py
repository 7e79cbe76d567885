"""What a sweep reports and leaves behind: each member's eval metrics under its label, the
best member, a summary (a table in the log, `sweep.json`, `sweep.png`) and the best member
exported as a single-model checkpoint.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import ml_collections
import numpy as np

from trainer.loop.actions import Action, Produced, StepView
from trainer.step.optim import create_schedule, optimizer_for
from trainer.sweep import plots, schedulers
from trainer.sweep.lr_find import LrFind
from trainer.sweep.members import Sweep
from trainer.sweep.optimizer import single_model_opt_state
from trainer.sweep.scheduler_base import Scheduler
from trainer.sweep.select import Selection
from trainer.sweep.train_report import MemberTrainMetrics

if TYPE_CHECKING:  # Only annotations: clu's writers import TensorFlow (seconds).
  from clu import metric_writers

Batch = Mapping[str, Any]
PyTree = Any

#: `FitResult.stopped_by` of a sweep that ended because no trial is left: its work is done.
FINISHED = "sweep finished: every configuration stopped or completed its steps"


class SweepReport(Action):
  """A sweep's results and choices: each slot's eval metrics under its configuration's
  label, the scheduler's decision at each evaluation (applied to the state: a
  `trainer.sweep.select.Selection`), the best member, and a summary at the end (a table
  in the log, `sweep.json`, the plots) with the best member exported.

  Args:
    writer: where `eval/<label>/<metric>` scalars go.
    evaluate_members: `(state, batches) -> [results of member i]`.
    eval_batches: returns a fresh iterable of eval batches per evaluation.
    selection: the scheduler and how its decisions reach the state.
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
               eval_batches: Callable[[], Iterable[Batch]], *, selection: Selection,
               every_steps: int, metric: str, mode: str,
               summarize: Callable[[Any, int, list[dict[str, float]], int], None]):
    if mode not in ("min", "max"):
      raise ValueError(f"config.sweep.mode={mode!r} must be 'min' or 'max'.")
    super().__init__(every_steps=every_steps)
    self.writer, self.evaluate_members, self.eval_batches = writer, evaluate_members, eval_batches
    self.selection, self.metric, self.mode, self.summarize = selection, metric, mode, summarize
    self.results: list[dict[str, float]] | None = None
    self._last: int | None = None

  def begin(self, view: StepView) -> Produced | None:
    scheduler = self.selection.scheduler  # `fit(num_steps)` is each trial's length.
    scheduler.set_budget(view.num_steps // scheduler.rounds)
    if scheduler.name == "halving" and any(r >= scheduler.budget for r in scheduler.rungs):
      raise ValueError(
          f"config.sweep.halving.rungs={scheduler.rungs}: a trial trains "
          f"{scheduler.budget} steps (fit's num_steps), so every rung must be below that.")
    state = self.selection.start(view.state, view.step)  # A study asks its first trials.
    return None if state is view.state else Produced(state=state)

  def triggers(self, view: StepView) -> bool:
    """At each evaluation, and where a trial ends its budget (under a scheduler)."""
    if view.preempted:
      return False
    due = self.selection.scheduler.next_due(view.previous_step)
    return super().triggers(view) or (due is not None and due <= view.step)

  def next_boundary(self, step: int) -> int | None:
    due = self.selection.scheduler.next_due(step)
    every = super().next_boundary(step)
    return min(b for b in (due, every) if b is not None) if (due or every) else None

  def run(self, view: StepView) -> Produced:
    start = time.perf_counter()
    results = self.evaluate_members(view.state, self.eval_batches())
    self.results = results
    self.writer.write_scalars(view.step, {f"eval/{label}/{k}": v for label, r in
                                          zip(self.selection.labels(), results, strict=True)
                                          if label is not None for k, v in r.items()})
    state, decision = self.selection.choose(
        view.state, view.step, [r[self.metric_name()] for r in results], last=view.is_last)
    self._last = view.step
    best = self.best()
    finished = decision.finished and not view.is_last
    return Produced(eval_seconds=time.perf_counter() - start,
                    best=(view.step, results[best][self.metric_name()]),
                    state=None if state is view.state else state,
                    stop=FINISHED if finished else None)

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
      produced = self.run(dataclasses.replace(view, num_steps=view.step))  # The last one.
    if self.results is not None:
      self.summarize(view.state, view.step, self.results, self.best())
    self.selection.scheduler.finish(view.step)
    return produced

  def state_dict(self) -> dict[str, Any] | None:
    """The scheduler's history and choices (resumed with the run's checkpoint)."""
    return self.selection.scheduler.state_dict()

  def load_state_dict(self, state: dict[str, Any]) -> None:
    self.selection.scheduler.load_state_dict(state)


def summary_rows(sweep: Sweep, results: Sequence[Mapping[str, float]],
                 scheduler: Scheduler | None = None) -> list[dict[str, Any]]:
  """One row per member (slot): the configuration it holds (the last one, under a
  scheduler), its label, swept values and results."""
  rows = []
  for i, r in enumerate(results):
    record = scheduler.last_record(i) if scheduler is not None else None
    if record is None and scheduler is not None and scheduler.name == "study":
      # A slot the study never filled (other runs on it took the trials).
      rows.append({"member": i, "trial": None, "label": "(no trial)",
                   **{n: sweep.base[n] for n in sweep.varied}, **dict(r)})
      continue
    trial = i if record is None else record["trial"]
    values = sweep.members[i] if record is None else record["values"]
    rows.append({"member": i, "trial": trial, "label": sweep.label(trial),
                 **{n: values[n] for n in sweep.varied}, **dict(r)})
  return rows


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
  limits = plots.readable_limits([r[metric] for r in rows])
  for ax, name in zip(axes[0], names, strict=True):
    for seed in seeds:
      mine = [r for r in rows if r.get("seed", 0) == seed]
      ax.scatter([r[name] for r in mine], [r[metric] for r in mine], label=f"seed {seed}")
    ax.scatter([rows[best][name]], [rows[best][metric]], s=160, facecolors="none",
               edgecolors="black", label="best")
    plots.mark_off_scale(ax, [r[name] for r in rows], [r[metric] for r in rows], limits)
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
                  labels: Callable[[PyTree], PyTree] | None = None,
                  step: int | None = None, trial: int | None = None,
                  values: Mapping[str, float] | None = None) -> None:
  """Writes sweep member `member` of `state` as a single-model checkpoint in `directory`.

  It restores under any single-model strategy built from
  `sweep.member_config(config, member)`, and a run there resumes from it: its
  optimizer state is converted to the layout of that config's optimizer
  (`trainer.step.optim.optimizer_for`, grouped by `labels` when given, with a
  schedule over `num_train_steps`). Under a scheduler, the slot `member` holds
  configuration `trial` with `values` (after PBT explored them), `step` steps in.
  An earlier export in `directory` (the sweep's best so far) is replaced. A run of
  several processes exports nothing (it logs how to restore the member instead).
  """
  from strategies.single_device import SingleDevice
  from trainer.checkpoint import Checkpointer, RunState, save_run
  if jax.process_count() > 1:  # A one-device checkpoint is written by one process.
    logging.warning("Sweep member %d not exported: a run of %d processes keeps its members in "
                    "its own checkpoints; restore one in a single process with "
                    "Trainer.restore_checkpoint(..., member=%d).", member,
                    jax.process_count(), member)
    return
  one = jax.tree.map(lambda x: x[member], strategy.to_canonical(state))
  if step is not None:
    one = one.replace(step=np.asarray(step, np.asarray(one.step).dtype))
  trial = member if trial is None else trial
  member_config = sweep.member_config(config, trial, values)
  plain = optimizer_for(member_config, create_schedule(member_config, num_train_steps),
                        labels=labels)
  one = one.replace(opt_state=single_model_opt_state(one.opt_state, plain.init(one.params)))
  if getattr(one, "ema_decay", None) is not None:  # A fixed decay there: from its config.
    one = one.replace(ema_decay=None)
  single = SingleDevice()
  if os.path.isdir(directory):  # This sweep's earlier export (a better member since).
    logging.info("Replacing the sweep's earlier export in %s", directory)
    shutil.rmtree(directory)
  checkpointer = Checkpointer(directory, every_steps=0, async_save=False)
  try:
    save_run(checkpointer, single, RunState(jax.device_put(one, single.device), int(one.step)))
    checkpointer.wait()
  finally:
    checkpointer.close()
  logging.info("Sweep member %d (%s) exported to %s", member, sweep.label(trial), directory)


def plot_curves(scheduler: Scheduler, metric: str, path: str) -> None:
  """Saves a PNG of every trial's `metric` against the run's steps, one colour per
  configuration: a circle where a trial started in a refilled slot, a cross where one
  was stopped, a triangle where a member copied another (PBT)."""
  import matplotlib
  matplotlib.use("Agg")  # Files only: no display.
  from matplotlib import pyplot as plt

  fig, ax = plt.subplots(figsize=(7, 4))
  colours = plt.get_cmap("viridis")
  n = max(len(scheduler.sweep) - 1, 1)
  ends = [(r["curve"][-1][0], r["curve"][-1][2]) for r in scheduler.trials if r["curve"]]
  limits = plots.readable_limits([p[2] for r in scheduler.trials for p in r["curve"]])
  for r in scheduler.trials:
    if not r["curve"]:
      continue
    steps = [p[0] for p in r["curve"]]
    values = [p[2] for p in r["curve"]]
    colour = colours(r["trial"] / n)
    ax.plot(steps, values, color=colour, lw=1)
    if r["start"] > 0:
      ax.scatter([steps[0]], [values[0]], color=colour,
                 marker="^" if "parent" in r else "o", s=30)
    if r["status"] == "stopped":
      ax.scatter([steps[-1]], [values[-1]], color=colour, marker="x", s=40)
  # A trial that ended diverged or NaN: marked at its last step, on the edge.
  off = plots.mark_off_scale(ax, *zip(*ends, strict=True), limits) if ends else 0
  ax.set_xlabel("step")
  ax.set_ylabel(metric)
  ax.set_title(f"{scheduler.name or 'grid'}: o refilled, x stopped, ^ copied"
               + (", red: off the scale (diverged or NaN)" if off else ""))
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def summarize(state: PyTree, step: int, results: list[dict[str, float]], best: int, *,
              sweep: Sweep, scheduler: Scheduler, config: ml_collections.ConfigDict,
              workdir: str | None, export: Callable[..., None]) -> None:
  """A sweep's summary: a table in the log; with a `workdir`, `sweep.json` (every
  member's results, every trial's history, the scheduler's events and lineage, the
  model-steps spent), `sweep.png` (the metric against each swept hyperparameter),
  `sweep_curves.png` (each trial's metric against steps) and the best member as a
  single-model checkpoint in `<workdir>/sweep_best` (`export`; its config beside it,
  `sweep_best_config.json`).

  Under a scheduler the best is the best trial that completed its steps; one whose
  slot was refilled after it completed was exported then (`Selection`).
  """
  rows = summary_rows(sweep, results, scheduler)
  names = list(results[0])
  metric = config.sweep.metric or names[0]
  record = scheduler.best_trial() if scheduler.name else None
  if scheduler.name == "study" and record is None:  # No trial of this run completed.
    logging.info("Sweep at step %d: no trial of this run completed.", step)
    _write_summary(workdir, step, metric, config, scheduler, None, rows)
    return
  slot, trial, values, age = best, rows[best]["trial"], None, None  # The grid's.
  best_row = rows[best]
  if scheduler.name:
    slot = record["slot"] if scheduler.last_record(record["slot"]) is record else None
    trial, values = record["trial"], record["values"]
    age = (record["end"] if record["end"] is not None else step) - record["start"]
    best_row = rows[slot] if slot is not None else {
        "trial": trial, "label": sweep.label(trial), metric: record["curve"][-1][2]}
  logging.info("Sweep at step %d, best %s (%s):\n%s", step,
               f"member {slot}" if slot is not None else f"trial {trial}", sweep.label(trial),
               format_table(rows, ["label", *names]))
  tied = [r["label"] for i, r in enumerate(rows)
          if i != slot and best_row.get(metric) is not None and r.get(metric) == best_row[metric]]
  if tied:  # argmax keeps the first: say that the choice among them was no choice.
    best_row = {**best_row, "tied_with": tied}
    logging.info("Sweep: %s tie with the best (%s=%s); the first is the one kept.",
                 ", ".join(tied), metric, best_row[metric])
  if not _write_summary(workdir, step, metric, config, scheduler, best_row, rows):
    return
  plot_rows, plot_best = rows, best
  if scheduler.name == "study":  # Every trial, at its last evaluation.
    plot_rows = [{"trial": r["trial"], **r["values"], metric: r["curve"][-1][2]}
                 for r in scheduler.trials if r["curve"]]
    plot_best = next(i for i, r in enumerate(plot_rows) if r["trial"] == trial)
  plot(plot_rows, sweep.varied, metric, plot_best, os.path.join(workdir, "sweep.png"))
  plot_curves(scheduler, metric, os.path.join(workdir, "sweep_curves.png"))
  if record is not None and not scheduler.should_export(record):
    logging.info("Sweep: trial %d is this run's best, not the study's; not exported.", trial)
    return
  if slot is not None:
    export(state, slot, os.path.join(workdir, "sweep_best"), step=age, trial=trial,
           values=values)
    scheduler.on_export(trial, os.path.join(workdir, "sweep_best"))
  with open(os.path.join(workdir, "sweep_best_config.json"), "w") as f:
    f.write(sweep.member_config(config, trial, values).to_json(indent=1))


def _write_summary(workdir: str | None, step: int, metric: str,
                   config: ml_collections.ConfigDict, scheduler: Scheduler,
                   best_row: Mapping[str, Any] | None, rows: list[dict[str, Any]]) -> bool:
  """Writes `sweep.json` (process 0, with a workdir); False where nothing is written."""
  if not workdir or jax.process_index() > 0:
    return False
  os.makedirs(workdir, exist_ok=True)
  summary = {"step": step, "metric": metric, "mode": config.sweep.mode,
             "scheduler": scheduler.name, "budget": scheduler.budget,
             "model_steps": scheduler.model_steps(step), "best": best_row, "members": rows,
             "trials": scheduler.trials, "events": scheduler.events,
             "lineage": getattr(scheduler, "lineage", [])}
  if (study := scheduler.summary()) is not None:
    summary["study"] = study
  with open(os.path.join(workdir, "sweep.json"), "w") as f:
    json.dump(summary, f, indent=1)
  return True


def actions(sweep: Sweep, config: ml_collections.ConfigDict, *, strategy: Any,
            writer: metric_writers.MetricWriter,
            evaluate_members: Callable[[Any, Iterable[Batch]], list[dict[str, float]]],
            eval_batches: Callable[[], Iterable[Batch]], workdir: str | None,
            num_train_steps: int | None,
            init_members: Callable[[list[int]], PyTree] | None = None,
            labels: Callable[[PyTree], PyTree] | None = None) -> list[Action]:
  """The sweep's actions for a run: with `config.sweep.lr_find`, the range test's `LrFind`;
  each member's train loss and metric (`MemberTrainMetrics`); with `eval_batches`, its
  `SweepReport`, which evaluates every member at each
  evaluation, applies the scheduler's choices (`config.sweep.scheduler`) and summarizes
  the sweep at the end (`summarize`, `export_member`).

  Args:
    strategy: the ensemble strategy that holds the members.
    writer: where each member's `eval/<label>/<metric>` goes.
    evaluate_members: `(state, batches) -> [results of member i]`
      (`trainer.evaluation.Evaluator.evaluate_members`).
    eval_batches: returns a fresh iterable of eval batches per evaluation.
    workdir: where the summary files and the best member go (None: the log only).
    num_train_steps, labels: how the exported member's optimizer is built
      (`export_member`).
    init_members: `seeds -> placed state` for slots refilled with a new configuration
      (`trainer.run.States.init_members`); needed by `scheduler='halving'`.
  """
  found = ([LrFind(sweep, fetch_metrics=strategy.fetch_metrics, workdir=workdir)]
           if config.sweep.lr_find else [])
  member_train = functools.partial(
      MemberTrainMetrics, writer, fetch_metrics=strategy.fetch_metrics,
      names=("loss", config.sweep.metric) if config.sweep.metric else ("loss",),
      every_steps=config.log_every_steps)
  if eval_batches is None:  # Nothing to report or choose from.
    return found + [member_train(labels=lambda: [sweep.label(i) for i in range(len(sweep))])]
  export = functools.partial(export_member, sweep=sweep, config=config, strategy=strategy,
                             num_train_steps=num_train_steps, labels=labels)
  if sweep.scheduler == "study":  # Opens (or creates) the study: its storage is checked here.
    from trainer.sweep import study
    scheduler = study.create(config, sweep, slots=strategy.num_members, workdir=workdir)
  else:
    scheduler = schedulers.create(config, sweep, slots=strategy.num_members, budget=0)
  selection = Selection(scheduler, init_members=init_members, export=export, workdir=workdir)
  return found + [member_train(labels=selection.labels),
                  SweepReport(writer, evaluate_members, eval_batches, selection=selection,
                      every_steps=config.eval_every_steps, metric=config.sweep.metric,
                      mode=config.sweep.mode,
                      summarize=functools.partial(summarize, sweep=sweep, scheduler=scheduler,
                                                  config=config, workdir=workdir,
                                                  export=export))]
