"""A Trainer for softmax classifiers, with ensemble-aware evaluation."""

# No `from __future__ import annotations`: clu reads metric classes from annotations.
import flax
import jax
import jax.numpy as jnp
import optax
from clu import metrics

from trainer import metrics as metrics_lib
from trainer.trainer import MASK_KEY, Batch, Trainer


@flax.struct.dataclass
class ClassificationEvalMetrics(metrics.Collection):
  accuracy: metrics.Average.from_output("correct")
  nll: metrics.Average.from_output("nll")


@flax.struct.dataclass
class EnsembleEvalMetrics(metrics.Collection):
  """Metrics of the ensemble's mean probabilities and of its individual members.

  Member metrics are computed per member; the strategy merges them over
  members, which averages them.
  """

  ensemble_accuracy: metrics.Average.from_output("ensemble_correct")
  member_accuracy: metrics.Average.from_output("member_correct")
  ensemble_nll: metrics.Average.from_output("ensemble_nll")
  member_nll: metrics.Average.from_output("member_nll")


def _nll(probs: jax.Array, labels: jax.Array) -> jax.Array:
  """Negative log-likelihood of integer labels under (possibly averaged) probabilities."""
  p = jnp.take_along_axis(probs, labels[..., None], axis=-1)[..., 0]
  return -jnp.log(jnp.maximum(p, jnp.finfo(p.dtype).tiny))


class ClassificationTrainer(Trainer):
  """Cross-entropy on integer labels; a subclass only supplies `build_model`.

  The model returns logits. Ensemble strategies report `ensemble_*` metrics of
  the mean member probabilities beside the mean `member_*` metrics.
  """

  input_key = "image"
  target_key = "label"

  def loss(self, logits: jax.Array, batch: Batch) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[self.target_key])

  def train_metrics(self, logits, batch, loss):
    correct = jnp.argmax(logits, -1) == batch[self.target_key]
    return metrics_lib.ClassificationTrainMetrics.single_from_model_output(
        loss=loss, correct=correct.astype(jnp.float32))

  def eval_metrics(self, logits, batch):
    labels, mask = batch[self.target_key], batch[MASK_KEY]
    probs = jax.nn.softmax(logits, axis=-1)
    member_correct = (jnp.argmax(logits, -1) == labels).astype(jnp.float32)
    member_nll = _nll(probs, labels)
    if self.strategy.num_members == 1:
      return ClassificationEvalMetrics.single_from_model_output(
          correct=member_correct, nll=member_nll, mask=mask)
    ensemble_probs = self.strategy.mean_over_members(probs)
    return EnsembleEvalMetrics.single_from_model_output(
        ensemble_correct=(jnp.argmax(ensemble_probs, -1) == labels).astype(jnp.float32),
        member_correct=member_correct,
        ensemble_nll=_nll(ensemble_probs, labels),
        member_nll=member_nll,
        mask=mask)
