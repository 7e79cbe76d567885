"""Axes a reader can read when a member diverged: the range of the values being compared, and
what falls outside it marked at the edge instead of stretching the axis.

A sweep or a learning-rate range test that tries rates up to divergence has a
member whose loss reaches 1e11, or NaN: on a linear axis the other members
become a flat line at zero. Every plot of `trainer.sweep` takes its y-range
from the members that did not diverge (`readable_limits`) and marks the rest
on the axis' edge (`mark_off_scale`), as Lightning's `lr_find` plot leaves
the diverged end of its curve off the axis.
"""

from __future__ import annotations

import numpy as np

#: How far from the median the axis reaches, in median absolute deviations of the values.
REACH = 10.0


def readable_limits(values, keep=None) -> tuple[float, float] | None:
  """y-limits for the finite `values` (those `keep` selects, when given, else all), without
  outliers farther than `REACH` median absolute deviations from their median; None if
  none is finite."""
  v = np.asarray(values, float)
  if keep is not None:
    v = v[np.asarray(keep, bool)]
  v = v[np.isfinite(v)].ravel()
  if not v.size and keep is not None:
    return readable_limits(values)  # Every member diverged: the finite values of all.
  if not v.size:
    return None
  middle = np.median(v)
  spread = np.median(np.abs(v - middle)) or abs(middle) or 1.0  # Robust to a few outliers.
  inside = v[np.abs(v - middle) <= REACH * spread]
  lo, hi = float(inside.min()), float(inside.max())
  pad = 0.05 * ((hi - lo) or abs(hi) or 1.0)
  return lo - pad, hi + pad


def mark_off_scale(ax, xs, ys, limits) -> int:
  """Marks the points of `(xs, ys)` that are not finite or fall outside `limits` on the
  axis' edge (red diamonds: at the top for NaN and values above, at the bottom for values
  below; labelled once) and sets the limits; returns how many were marked."""
  if limits is None:
    return 0
  xs, ys = np.asarray(xs, float), np.asarray(ys, float)
  lo, hi = limits
  below = np.isfinite(ys) & (ys < lo)
  out = ~np.isfinite(ys) | (ys > hi) | below
  if out.any():
    ax.scatter(xs[out], np.where(below, lo, hi)[out], marker="D", color="red", clip_on=False,
               zorder=3, label="off the scale (diverged or NaN)")
  ax.set_ylim(*limits)
  return int(out.sum())
