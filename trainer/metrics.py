"""clu metric collections for training and evaluation, and calibration metrics."""

# No `from __future__ import annotations`: clu reads metric classes from annotations.

import functools
from collections.abc import Mapping
from typing import Any

import flax
import jax
import jax.numpy as jnp
from clu import metrics

ECE_BINS = 15


@flax.struct.dataclass
class LossMetrics(metrics.Collection):
  """The mean per-example loss."""

  loss: metrics.Average.from_output("loss")


@flax.struct.dataclass
class NanAverage(metrics.Average):
  """The average of the values that are not NaN, among those the `mask` keeps (an RL
  reward that applies to some completions only, a step whose reward std is undefined)."""

  @classmethod
  def from_model_output(cls, values: jax.Array, mask: jax.Array | None = None, **_
                        ) -> "NanAverage":
    values = jnp.atleast_1d(jnp.asarray(values, jnp.float32))
    keep = ~jnp.isnan(values)
    if mask is not None:
      mask = jnp.asarray(mask, bool)
      keep = keep & mask.reshape(mask.shape + (1,) * (values.ndim - mask.ndim))
    return super().from_model_output(jnp.where(keep, values, 0.0), mask=keep)


@functools.cache
def moe_train_metrics(num_experts: int) -> type[metrics.Collection]:
  """The loss and a mixture of experts' router metrics (`models.moe.summarize`): the
  load-balancing and z losses, the dropped fraction, the largest expert's load (its share
  times the experts: 1 balanced, `experts` when all choose one) and each expert's share."""
  fields = {name: metrics.Average.from_output(name) for name in (
      "loss", "moe_load_balance", "moe_router_z", "moe_dropped_fraction", "moe_max_load")}
  fields.update({f"moe_expert_{e}_share": metrics.Average.from_output(f"moe_expert_{e}_share")
                 for e in range(num_experts)})
  return metrics.Collection.create(**fields)


@flax.struct.dataclass
class ClassificationTrainMetrics(metrics.Collection):
  loss: metrics.Average.from_output("loss")
  accuracy: metrics.Average.from_output("correct")


@flax.struct.dataclass
class CalibrationError(metrics.Metric):
  """Expected calibration error over `ECE_BINS` equal-width confidence bins.

  An example's confidence is its largest probability; it falls in bin b when
  b/B < confidence <= (b+1)/B. ECE = `sum_b |correct_b - confidence_b| / N`,
  where correct_b and confidence_b are sums over the examples in bin b. The
  per-bin sums merge exactly across batches, devices and steps.
  """

  count: jax.Array
  confidence: jax.Array
  correct: jax.Array

  @classmethod
  def empty(cls) -> "CalibrationError":
    zeros = jnp.zeros((ECE_BINS,), jnp.float32)
    return cls(count=zeros, confidence=zeros, correct=zeros)

  @classmethod
  def from_probs(cls, probs: jax.Array, labels: jax.Array,
                 mask: jax.Array | None = None) -> "CalibrationError":
    confidence = probs.max(axis=-1)
    correct = (probs.argmax(axis=-1) == labels).astype(jnp.float32)
    weight = jnp.ones_like(confidence) if mask is None else mask.astype(jnp.float32)
    bins = jnp.clip(jnp.ceil(confidence * ECE_BINS).astype(jnp.int32) - 1, 0, ECE_BINS - 1)
    one_hot = jax.nn.one_hot(bins, ECE_BINS) * weight[:, None]
    return cls(count=one_hot.sum(0), confidence=one_hot.T @ confidence,
               correct=one_hot.T @ correct)

  @classmethod
  def from_output(cls, probs_name: str):
    """A metric class reading probabilities `probs_name` and `labels` (and `mask`)."""

    @flax.struct.dataclass
    class FromOutput(cls):
      @classmethod
      def from_model_output(cls, **outputs) -> "CalibrationError":
        metric = CalibrationError.from_probs(outputs[probs_name], outputs["labels"],
                                             outputs.get("mask"))
        return cls(**vars(metric))

    return FromOutput

  def merge(self, other: "CalibrationError") -> "CalibrationError":
    return type(self)(count=self.count + other.count,
                      confidence=self.confidence + other.confidence,
                      correct=self.correct + other.correct)

  def compute(self) -> jax.Array:
    # The bins are the last axis; any leading axis (members) is averaged over the rows
    # that saw examples (one member's row alone is that member's ECE, as a sweep
    # reports it). Array methods only, so host (numpy) metrics compute without a jax op.
    gaps = abs(self.correct - self.confidence).sum(-1)
    totals = self.count.sum(-1)
    seen = (totals > 0).astype(gaps.dtype)
    return (gaps / totals.clip(min=1) * seen).sum() / seen.sum().clip(min=1)


@flax.struct.dataclass
class MemberCalibrationError(CalibrationError):
  """The mean over ensemble members of each member's own ECE.

  Pooling all members' examples into one set of bins would let one member's
  over-confidence cancel another's under-confidence, so the bins keep a member
  axis: `[num_members, ECE_BINS]`, where a step fills row `member_index`.
  Merging over batches, steps and members is then an exact sum, and
  `compute` averages the per-row ECEs.
  """

  @classmethod
  def empty(cls) -> "MemberCalibrationError":
    zeros = jnp.zeros((1, ECE_BINS), jnp.float32)  # One member; merge needs equal shapes.
    return cls(count=zeros, confidence=zeros, correct=zeros)

  @classmethod
  def from_model_output(cls, *, probs, labels, member_index, num_members, mask=None,
                        **_) -> "MemberCalibrationError":
    bins = CalibrationError.from_probs(probs, labels, mask)
    row = jax.nn.one_hot(member_index, num_members)[:, None]
    return cls(count=row * bins.count, confidence=row * bins.confidence,
               correct=row * bins.correct)


def nll(probs: jax.Array, labels: jax.Array) -> jax.Array:
  """Per-example negative log-likelihood of integer labels under probabilities."""
  p = jnp.take_along_axis(probs, labels[..., None], axis=-1)[..., 0]
  return -jnp.log(jnp.maximum(p, jnp.finfo(p.dtype).tiny))


@flax.struct.dataclass
class ClassificationEvalMetrics(metrics.Collection):
  accuracy: metrics.Average.from_output("correct")
  nll: metrics.Average.from_output("nll")
  ece: CalibrationError.from_output("probs")


@flax.struct.dataclass
class EnsembleEvalMetrics(metrics.Collection):
  """Metrics of the ensemble's mean probabilities and of its individual members.

  `member_*` and `disagreement` are computed per member; strategies merge
  them over members, which averages them (`member_ece` is the mean of the
  members' own ECEs, see `MemberCalibrationError`). `disagreement` is the fraction of
  examples on which a member's argmax differs from the ensemble's argmax,
  averaged over members.
  """

  ensemble_accuracy: metrics.Average.from_output("ensemble_correct")
  member_accuracy: metrics.Average.from_output("member_correct")
  ensemble_nll: metrics.Average.from_output("ensemble_nll")
  member_nll: metrics.Average.from_output("member_nll")
  ensemble_ece: CalibrationError.from_output("ensemble_probs")
  member_ece: MemberCalibrationError
  disagreement: metrics.Average.from_output("disagrees")


#: A metric field named `a__b` is reported as `a/b`: the names other libraries log (TRL's
#: `completions/mean_length`) hold slashes, which a collection's field name cannot.
GROUP_SEPARATOR = "__"


def reported_name(field: str) -> str:
  """The name a metric field is reported under (`GROUP_SEPARATOR`)."""
  return field.replace(GROUP_SEPARATOR, "/")


def field_name(name: str) -> str:
  """The collection field of a reported metric name (`reported_name`'s inverse)."""
  return name.replace("/", GROUP_SEPARATOR)


def collection_of(metric_classes: Mapping[str, type[metrics.Metric]]
                  ) -> type[metrics.Collection]:
  """A collection of `{reported name: metric class}` (`TRL`'s `rewards/chosen` as well as
  `loss`), each metric reading the model output of its own name (`outputs`)."""
  return metrics.Collection.create(**{field_name(n): cls.from_output(field_name(n))
                                      for n, cls in metric_classes.items()})


def outputs(values: Mapping[str, Any]) -> dict[str, Any]:
  """Model outputs under reported names, as `collection_of`'s metrics read them."""
  return {field_name(k): v for k, v in values.items()}


def with_average(collection: metrics.Collection, name: str, value: jax.Array
                 ) -> metrics.Collection:
  """`collection` and one more metric, the `Average` of `value` under `name` (a field of
  that name already there is left as it is)."""
  fields = {k: v for k, v in vars(collection).items() if k != "_reduction_counter"}
  if name in fields:
    return collection
  extended = _extended(tuple((k, type(v)) for k, v in fields.items()), name)
  return extended(_reduction_counter=collection._reduction_counter,  # noqa: SLF001
                  **fields, **{name: metrics.Average.from_model_output(value)})


@functools.cache
def _extended(fields: tuple[tuple[str, type], ...], name: str) -> type[metrics.Collection]:
  """One class per collection layout, so that every step's collections merge."""
  return metrics.Collection.create(**dict(fields), **{name: metrics.Average})


def scalars(collection: metrics.Collection) -> dict[str, float]:
  """Computed metric values as plain Python floats, under their reported names."""
  return {reported_name(k): float(v) for k, v in collection.compute().items()}
