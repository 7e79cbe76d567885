"""clu metric collections for training and evaluation."""

# No `from __future__ import annotations`: clu reads metric classes from annotations.
import functools
from collections.abc import Sequence

import flax
from clu import metrics


@flax.struct.dataclass
class LossMetrics(metrics.Collection):
  """The mean per-example loss."""

  loss: metrics.Average.from_output("loss")


@flax.struct.dataclass
class ClassificationTrainMetrics(metrics.Collection):
  loss: metrics.Average.from_output("loss")
  accuracy: metrics.Average.from_output("correct")


def merge_all(collections: Sequence[metrics.Collection]) -> metrics.Collection:
  """Merges a sequence of host-side collections in order (steps or batches)."""
  return functools.reduce(lambda a, b: a.merge(b), collections)


def scalars(collection: metrics.Collection) -> dict[str, float]:
  """Computed metric values as plain Python floats."""
  return {k: float(v) for k, v in collection.compute().items()}
