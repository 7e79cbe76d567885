"""Every plot the sweeps write stays readable with a diverged (1e11) or NaN member: the y-axis
spans the stable members, and the others are marked on its edge (`trainer.sweep.plots`)."""

import types

import matplotlib
import numpy as np
import pytest

matplotlib.use("Agg")
from matplotlib.figure import Figure  # noqa: E402

from trainer.sweep import lr_find, plots, report  # noqa: E402

RATES = np.geomspace(1e-3, 1.0, 8)


@pytest.fixture
def figures(monkeypatch):
  """The figures the plot functions save, kept for their axes."""
  saved, write = [], Figure.savefig

  def keep(self, *args, **kwargs):
    saved.append(self)
    return write(self, *args, **kwargs)

  monkeypatch.setattr(Figure, "savefig", keep)
  return saved


def _losses(steps=30):
  """8 rates: the losses fall by rate, the 7th diverges to 1e11, the 8th turns NaN."""
  t = np.arange(steps)
  losses = np.stack([2.3 - 0.02 * (i + 1) * np.log1p(t) for i in range(len(RATES))])
  losses[6] = 2.3 * np.exp(t * np.log(1e11 / 2.3) / (steps - 1))
  losses[7, steps // 3:] = np.nan
  return losses


def _marked(ax) -> int:
  return sum(len(c.get_offsets()) for c in ax.collections
             if c.get_label().startswith("off the scale"))


def test_the_range_tests_plot_spans_the_stable_rates(tmp_path, figures):
  losses = _losses()
  result = lr_find.suggest(RATES, losses)
  assert result["diverged"][6] and result["diverged"][7] and not any(result["diverged"][:6])
  lr_find.plot(RATES, losses, result, str(tmp_path / "lr_find.png"))
  left, right = figures[-1].axes
  stable = lr_find.smooth(losses[:6])
  lo, hi = left.get_ylim()
  assert lo <= stable.min() and stable.max() <= hi < 3.0  # Not 0 to 1.1e11.
  assert "diverged" in " ".join(t.get_text() for t in left.get_legend().get_texts())
  assert right.get_ylim()[1] < 3.0 and _marked(right) == 2


def test_the_sweeps_plots_span_the_stable_members(tmp_path, figures):
  rows = [{"learning_rate": float(r), "seed": 0, "nll": float(v)}
          for r, v in zip(RATES, [0.9, 0.7, 0.5, 0.4, 0.45, 0.6, 1e11, np.nan], strict=True)]
  report.plot(rows, ["learning_rate"], "nll", best=3, path=str(tmp_path / "sweep.png"))
  (ax,) = figures[-1].axes
  assert 0.4 > ax.get_ylim()[0] and 0.9 < ax.get_ylim()[1] < 2.0 and _marked(ax) == 2

  trials = [{"trial": i, "start": 0, "status": "completed",
             "curve": [[s, s, float(v)] for s, v in enumerate(curve, start=1)]}
            for i, curve in enumerate(_losses(10))]
  scheduler = types.SimpleNamespace(trials=trials, sweep=list(RATES), name="halving")
  report.plot_curves(scheduler, "loss", str(tmp_path / "sweep_curves.png"))
  (ax,) = figures[-1].axes
  assert ax.get_ylim()[1] < 3.0 and _marked(ax) == 2
  assert "off the scale" in ax.get_title()


def test_readable_limits_leave_out_what_diverged():
  assert plots.readable_limits([np.nan, np.inf]) is None
  lo, hi = plots.readable_limits([1.0, 2.0, 3.0, 1e11])
  assert lo < 1.0 and 3.0 < hi < 4.0
  lo, hi = plots.readable_limits([1.0, 2.0, 1e11], keep=[True, True, False])
  assert hi < 3.0
  assert plots.readable_limits([5.0, 1e11], keep=[False, False])[1] > 1e10  # All diverged.
