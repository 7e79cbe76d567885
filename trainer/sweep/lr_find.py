"""A learning-rate range test as one program (`config.sweep.lr_find`): the sweep's members
train at their learning rates (log-spaced, `lr_find_config`) for a few hundred steps, the
train loss of each is recorded at every step, and the end suggests a rate.

Smith 2017 ("Cyclical Learning Rates") and Lightning's `lr_find` raise one model's
rate step by step; here every rate is its own member, trained from the same seed on
the same batches in the one compiled program, so each curve is what that constant
rate does (warmup and decay as the config says). At the end:

- each member's curve is smoothed (an exponential moving average, debiased) and
  its *final loss* is the mean of the last tenth of it;
- a member *diverged* when its loss went non-finite or ended above `DIVERGED` (1.2)
  times where it began;
- `steepest`: the rate where the final loss falls fastest against log(rate), over
  the members that did not diverge (the suggestion, as Lightning suggests the
  steepest point of its curve); `largest_stable`: the largest rate that did not
  diverge; `lowest_loss`: the rate with the lowest final loss.

`lr_find.json` (the rates, curves, final losses and the three rates) and
`lr_find.png` (the curves, and final loss against rate with the suggestion
marked) go to the workdir.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from typing import Any

import jax
import ml_collections
import numpy as np

from trainer.loop.actions import Action, Produced, StepView
from trainer.sweep import plots
from trainer.sweep.members import Sweep

#: A member whose final loss is above this many times its first one diverged (a rate too
#: small to move stays near 1x; Lightning stops its finder at 4x the best loss).
DIVERGED = 1.2


def lr_find_config(config: ml_collections.ConfigDict, *, low: float, high: float,
                   num: int) -> ml_collections.ConfigDict:
  """`config` set up for a range test: `num` members at rates log-spaced over
  `[low, high]` (`config.sweep.grid.learning_rate`), no scheduler, `sweep.lr_find`."""
  config = ml_collections.ConfigDict(config.to_dict())
  config.sweep.grid.learning_rate = tuple(float(x) for x in np.geomspace(low, high, num))
  config.sweep.scheduler = ""
  config.sweep.lr_find = True
  return config


def smooth(losses: np.ndarray, beta: float = 0.9) -> np.ndarray:
  """An exponential moving average of each row, debiased (as fastai's finder smooths)."""
  out = np.empty_like(losses, dtype=float)
  avg = np.zeros(losses.shape[0])
  for t in range(losses.shape[1]):
    avg = beta * avg + (1 - beta) * losses[:, t]
    out[:, t] = avg / (1 - beta ** (t + 1))
  return out


def suggest(rates: Sequence[float], losses: np.ndarray) -> dict[str, Any]:
  """The range test's reading of `losses` (members x steps, at `rates`).

  Returns:
    `final_loss`, `diverged` (per member, in `rates`' order), and the rates
    `steepest` (the suggestion), `largest_stable` and `lowest_loss` (None where
    no member qualifies).
  """
  rates = np.asarray(rates, float)
  curves = smooth(np.where(np.isfinite(losses), losses, np.inf))
  tail = max(1, losses.shape[1] // 10)
  final = curves[:, -tail:].mean(axis=1)
  start = curves[:, 0]
  diverged = (~np.isfinite(final) | ~np.all(np.isfinite(losses), axis=1)
              | (final > DIVERGED * start))
  order = np.argsort(rates)
  ok = [i for i in order if not diverged[i]]
  steepest = None
  if len(ok) >= 2:
    slope = np.gradient(final[ok], np.log(rates[ok]))
    steepest = float(rates[ok][int(np.argmin(slope))])
  elif ok:
    steepest = float(rates[ok[0]])
  return {"final_loss": [float(x) for x in final], "diverged": [bool(d) for d in diverged],
          "steepest": steepest,
          "largest_stable": float(rates[ok[-1]]) if ok else None,
          "lowest_loss": float(rates[ok][int(np.argmin(final[ok]))]) if ok else None}


class LrFind(Action):
  """Records every member's train loss at every step; at the end, `suggest`s a rate and
  writes `lr_find.json` and `lr_find.png` to `workdir` (the log only without one).

  Args:
    sweep: the members (their learning rates).
    fetch_metrics: the strategy's `fetch_metrics` (device outputs to host trees).
    workdir: where the files go.
  """

  def __init__(self, sweep: Sweep, *, fetch_metrics, workdir: str | None):
    super().__init__(every_steps=1)
    self.sweep, self.fetch_metrics, self.workdir = sweep, fetch_metrics, workdir
    self.losses: list[np.ndarray] = []  # One (members,) row per step.
    self.result: dict[str, Any] | None = None

  def next_boundary(self, step: int) -> int | None:
    return None  # Reads each step's outputs (stacked over a call's steps), not the state.

  def run(self, view: StepView) -> None:
    metrics = self.fetch_metrics([view.outputs["metrics"]])[0]
    loss = np.asarray(metrics.loss.total, float) / np.maximum(
        np.asarray(metrics.loss.count, float), 1)
    if view.steps_axis is not None and loss.ndim == 2:  # (members, steps) of one call.
      loss = np.moveaxis(loss, view.steps_axis, 1)
      self.losses.extend(loss.T)
    else:
      self.losses.append(loss.reshape(-1))

  def end(self, view: StepView) -> Produced | None:
    if not self.losses or view.preempted:
      return None
    rates = self.sweep.column("learning_rate")
    losses = np.stack(self.losses, axis=1)
    self.result = {"learning_rates": [float(r) for r in rates], **suggest(rates, losses),
                   "steps": losses.shape[1]}
    logging.info("Learning-rate range test over %d steps: suggested %s (steepest descent), "
                 "largest stable %s, lowest loss at %s", losses.shape[1],
                 self.result["steepest"], self.result["largest_stable"],
                 self.result["lowest_loss"])
    if self.workdir and jax.process_index() == 0:
      os.makedirs(self.workdir, exist_ok=True)
      with open(os.path.join(self.workdir, "lr_find.json"), "w") as f:
        json.dump({**self.result, "losses": losses.tolist()}, f)
      plot(rates, losses, self.result, os.path.join(self.workdir, "lr_find.png"))
    return None


def plot(rates: Sequence[float], losses: np.ndarray, result: dict[str, Any], path: str) -> None:
  """Saves the range test's PNG: each rate's smoothed loss against steps, and the final
  loss against the rate (log scale) with the suggestion marked. Both y-axes show the
  range of the stable rates (`trainer.sweep.plots`): a diverged rate's curve is dashed
  and leaves the axis, its final loss a red mark on the edge."""
  import matplotlib
  matplotlib.use("Agg")  # Files only: no display.
  from matplotlib import pyplot as plt

  rates = np.asarray(rates, float)
  curves = smooth(np.where(np.isfinite(losses), losses, np.nan))
  final = np.asarray(result["final_loss"])
  diverged = np.asarray(result["diverged"])
  fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
  colours = plt.get_cmap("viridis")
  span = np.log(rates.max() / rates.min()) or 1.0
  for rate, curve, lost in zip(rates, curves, diverged, strict=True):
    left.plot(curve, color=colours(np.log(rate / rates.min()) / span), lw=1,
              ls="--" if lost else "-", label=f"{rate:.2g}" + (" diverged" if lost else ""))
  limits = plots.readable_limits(curves, np.repeat(~diverged[:, None], curves.shape[1], 1))
  if limits is not None:
    left.set_ylim(*limits)
  left.set_xlabel("step")
  left.set_ylabel("train loss (smoothed)")
  left.legend(fontsize="x-small", ncol=2)
  order = np.argsort(rates)
  right.plot(rates[order], np.where(diverged, np.nan, final)[order], marker="o")
  plots.mark_off_scale(right, rates, np.where(diverged, np.inf, final),
                       plots.readable_limits(final, ~diverged))
  if result["steepest"] is not None:
    right.axvline(result["steepest"], color="black", ls="--",
                  label=f"suggested {result['steepest']:.3g}")
  right.set_xscale("log")
  right.set_xlabel("learning rate")
  right.set_ylabel("final loss")
  right.legend(fontsize="small")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def check_config(config: ml_collections.ConfigDict, sweep: Sweep | None) -> None:
  """Raises unless `config.sweep.lr_find` has a sweep of learning rates to read.

  Raises:
    ValueError: naming the field, its value and what is accepted.
  """
  if not config.sweep.lr_find:
    return
  if sweep is None or "learning_rate" not in sweep.varied:
    raise ValueError("config.sweep.lr_find=True reads the loss of members at different "
                     "learning rates: set config.sweep.grid.learning_rate (e.g. with "
                     "trainer.sweep.lr_find_config(config, low=1e-4, high=1.0, num=16)).")
  others = [n for n in sweep.varied if n not in ("learning_rate", "seed")]
  if others or config.sweep.scheduler:
    raise ValueError(f"config.sweep.lr_find=True compares learning rates alone; the sweep "
                     f"also varies {others} and config.sweep.scheduler="
                     f"{config.sweep.scheduler!r}: vary only learning_rate, with no scheduler.")
  if len(set(sweep.seeds)) > 1:
    raise ValueError(f"config.sweep.lr_find=True compares rates from one seed; "
                     f"config.sweep.seeds={tuple(config.sweep.seeds)} has several.")
