"""A Trainer for softmax classifiers, with ensemble-aware evaluation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from strategies import Ensemble
from trainer import metrics as metrics_lib
from trainer.evaluation import MASK_KEY
from trainer.trainer import Batch, Trainer


class ClassificationTrainer(Trainer):
  """Cross-entropy on integer labels; a subclass only supplies `build_model`.

  The model returns logits. Single models report `accuracy`, `nll` and `ece`;
  ensemble strategies report `ensemble_*` metrics of the mean member
  probabilities beside the mean `member_*` metrics and `disagreement`
  (see `trainer.metrics.EnsembleEvalMetrics`).
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
    member_argmax = jnp.argmax(probs, -1)
    member_correct = (member_argmax == labels).astype(jnp.float32)
    if not isinstance(self.strategy, Ensemble):
      return metrics_lib.ClassificationEvalMetrics.single_from_model_output(
          correct=member_correct, nll=metrics_lib.nll(probs, labels), probs=probs,
          labels=labels, mask=mask)
    ensemble_probs = self.strategy.mean_over_members(probs)
    ensemble_argmax = jnp.argmax(ensemble_probs, -1)
    return metrics_lib.EnsembleEvalMetrics.single_from_model_output(
        ensemble_correct=(ensemble_argmax == labels).astype(jnp.float32),
        member_correct=member_correct,
        ensemble_nll=metrics_lib.nll(ensemble_probs, labels),
        member_nll=metrics_lib.nll(probs, labels),
        ensemble_probs=ensemble_probs,
        probs=probs,
        member_index=self.strategy.member_index(),
        num_members=self.strategy.num_members,
        disagrees=(member_argmax != ensemble_argmax).astype(jnp.float32),
        labels=labels,
        mask=mask)
