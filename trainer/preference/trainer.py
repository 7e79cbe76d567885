"""`PreferenceTrainer`: a language model trained on preference pairs (DPO, IPO, SimPO, ORPO).

A subclass of `LanguageModelTrainer` (the same model, layouts, LoRA and QLoRA, export),
whose batches are pairs (`trainer.preference.data`: `[pairs, 2, length]`, the chosen
sequence then the rejected) and whose loss is `config.preference.loss`
(`trainer.preference.losses`) of per-sequence log-probs. The chosen and rejected
sequences go through the model in one call of `2 x pairs` rows, as TRL concatenates them.
The reference is a part of its own (`trainer.preference.reference`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax
import jax
import jax.numpy as jnp
import ml_collections
from clu import metrics as clu_metrics

from models.moe import MoeOutput
from trainer import metrics as metrics_lib
from trainer.evaluation import MASK_KEY
from trainer.language_model import LanguageModelTrainer
from trainer.preference import losses as losses_lib
from trainer.preference import reference as reference_lib
from trainer.preference.data import COMPLETION_TOKENS, LOSS_WEIGHTS, REF_LOGPS, TARGET_MASK
from trainer.trainer import Batch

PyTree = Any


#: The loss, the rewards of the chosen and rejected responses, how often and by how much the
#: chosen one's is higher, the policy's summed log-probs of each response and the mean of
#: its logits over each response's tokens, under TRL 1.16's names (a clu `Collection` made
#: here: this module's annotations are strings, which clu cannot read).
PREFERENCE_METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies",
                      "rewards/margins", "logps/chosen", "logps/rejected", "logits/chosen",
                      "logits/rejected")
PreferenceMetrics = metrics_lib.collection_of(dict.fromkeys(PREFERENCE_METRICS,
                                                            clu_metrics.Average))


@flax.struct.dataclass
class PairOutputs:
  """What the model's call gives the loss: per-token log-probs of each pair's targets
  `[pairs, 2, length]`, the reference's per-sequence log-probs `[pairs, 2]` (None: a loss
  without one) and a mixture of experts' router outputs (None: dense)."""

  token_logps: jax.Array
  ref_logps: jax.Array | None = None
  #: Each target's logits averaged over the vocabulary `[pairs, 2, length]` (TRL's
  #: `logits/chosen`), without gradients.
  mean_logits: jax.Array | None = None
  router: Any = None
  #: A sweep member's beta (a scalar array); None: `config.preference.beta`.
  beta: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class Preference:
  """`config.preference`, checked."""

  loss: str
  beta: float
  simpo_gamma: float
  orpo_lambda: float
  reference: str  # One of reference.CHOICES but "auto", or "none".
  dropout: bool = False  # The policy's dropout while training (TRL turns it off).

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict) -> Preference:
    """Raises:
      ValueError: naming the field, the value and what is accepted.
    """
    if "preference" not in config:
      raise ValueError("PreferenceTrainer needs config.preference (configs/preference.py: "
                       "preference_fields()).")
    spec = config.preference
    if spec.loss not in losses_lib.LOSSES:
      raise ValueError(f"config.preference.loss={spec.loss!r} is not one of "
                       f"{losses_lib.LOSSES}.")
    for name in ("beta", "orpo_lambda"):
      value = spec[name]
      if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"config.preference.{name}={value!r} must be a number > 0.")
    if isinstance(spec.simpo_gamma, bool) or not isinstance(spec.simpo_gamma, int | float):
      raise ValueError(f"config.preference.simpo_gamma={spec.simpo_gamma!r} must be a number.")
    from strategies.context import CONTEXT_AXIS
    from strategies.pipeline import STAGE_AXIS
    axes = tuple(config.strategy.mesh_axes)
    for axis, what in ((STAGE_AXIS, "a pipeline"), (CONTEXT_AXIS, "context parallelism")):
      if axis in axes:
        raise ValueError(f"config.strategy.mesh_axes={axes}: preference training does not "
                         f"run under {what} (the {axis!r} axis); it runs under "
                         f"single_device, the pmap strategies and sharded_data_parallel "
                         f"with data, fsdp, tensor and expert axes.")
    from trainer.preference import data
    data.check_config(config)
    if not isinstance(spec.dropout, bool):
      raise ValueError(f"config.preference.dropout={spec.dropout!r} must be True or False.")
    return cls(spec.loss, float(spec.beta), float(spec.simpo_gamma), float(spec.orpo_lambda),
               reference_lib.choose(config), spec.dropout)


class PreferenceTrainer(LanguageModelTrainer):
  """Preference optimisation of `language_model(**config.model)` (see the module docstring).

  Attributes:
    preference: `config.preference`, checked before anything is built.
  """

  def __init__(self, config: ml_collections.ConfigDict, **kwargs):
    self.preference = Preference.from_config(config)  # Refused before any compute.
    super().__init__(config, **kwargs)
    self._reference_logps = None

  # -- The model's call --------------------------------------------------------------

  def model_inputs(self, batch: Batch, *, train: bool, rngs) -> tuple[tuple, dict]:
    """Each pair's two sequences as two rows, `[2 x pairs, length]`."""
    del train, rngs
    tokens = batch[self.input_key]
    return (tokens.reshape(-1, tokens.shape[-1]),), {}

  def _sequence_logps(self, params, model_state, batch, rngs, train):
    outputs, new_state = super().apply_model(params, model_state, batch, rngs=rngs,
                                             train=train)
    logits = outputs.logits if isinstance(outputs, MoeOutput) else outputs
    targets = batch[self.target_key]
    logits = logits.reshape(*targets.shape, logits.shape[-1])
    token = losses_lib.token_logps(logits, targets, self.config.model.vocab_size)
    mean = jax.lax.stop_gradient(logits[..., :self.config.model.vocab_size].astype(
        jnp.float32).mean(-1))
    return token, (outputs.router if isinstance(outputs, MoeOutput) else None), new_state, mean

  def apply_model(self, params: PyTree, model_state: PyTree, batch: Batch, *, rngs,
                  train: bool) -> tuple[PairOutputs, PyTree]:
    """The policy's per-token log-probs of both sequences (in eval mode, no dropout, unless
    `config.preference.dropout`), and the reference's per-sequence log-probs
    (`trainer.preference.reference`), without gradients."""
    passed = (reference_lib.REFERENCE, reference_lib.BETA)
    state = {k: v for k, v in model_state.items() if k not in passed}
    train = train and self.preference.dropout  # TRL's default: no dropout in the policy.
    token, router, new_state, mean_logits = self._sequence_logps(params, state, batch, rngs,
                                                                 train)
    choice, ref = self.preference.reference, None
    if choice == "precomputed" and REF_LOGPS in batch:
      ref = batch[REF_LOGPS]
    elif choice == "precomputed":  # The pass that computes them: the policy is the reference.
      ref = losses_lib.sequence_logps(token, batch[LOSS_WEIGHTS])
    elif choice in ("copy", "adapters_off"):
      weights = (model_state[reference_lib.REFERENCE] if choice == "copy"
                 else reference_lib.adapters_off(params))
      ref_token, _, _, _ = self._sequence_logps(jax.lax.stop_gradient(weights), state, batch,
                                                rngs, False)
      ref = losses_lib.sequence_logps(ref_token, batch[LOSS_WEIGHTS])
    if ref is not None:
      ref = jax.lax.stop_gradient(ref)
    new_state = {**new_state, **{k: model_state[k] for k in passed if k in model_state}}
    beta = model_state[reference_lib.BETA] if reference_lib.BETA in model_state else None
    return PairOutputs(token, ref, mean_logits=mean_logits, router=router, beta=beta), new_state

  # -- The loss ------------------------------------------------------------------------

  def pair_terms(self, outputs: PairOutputs, batch: Batch) -> dict[str, jax.Array]:
    """Each pair's loss, rewards and log-probs (`[pairs]` each)."""
    p, weights = self.preference, batch[LOSS_WEIGHTS]
    beta = p.beta if outputs.beta is None else outputs.beta  # Swept: per member.
    sums = losses_lib.sequence_logps(outputs.token_logps, weights)
    chosen, rejected = sums[:, 0], sums[:, 1]
    counts = jnp.maximum(weights.sum(axis=-1), 1.0)
    means = sums / counts
    if p.loss in losses_lib.WITH_REFERENCE:
      ref_chosen, ref_rejected = outputs.ref_logps[:, 0], outputs.ref_logps[:, 1]
      if p.loss == "sigmoid":
        loss = losses_lib.sigmoid(chosen, rejected, ref_chosen, ref_rejected, beta=beta)
      else:
        tokens = batch[COMPLETION_TOKENS]
        loss = losses_lib.ipo(chosen, rejected, ref_chosen, ref_rejected,
                              chosen_tokens=tokens[:, 0], rejected_tokens=tokens[:, 1],
                              beta=beta)
      rewards = beta * (sums - outputs.ref_logps)
    elif p.loss == "simpo":
      loss = losses_lib.simpo(means[:, 0], means[:, 1], beta=beta, gamma=p.simpo_gamma)
      rewards = beta * means
    else:  # ORPO: the chosen sequence's NLL over all its targets, the prompt's too.
      real = batch[TARGET_MASK][:, 0]
      nll = -(outputs.token_logps[:, 0] * real).sum(axis=-1)
      loss = losses_lib.orpo(means[:, 0], means[:, 1], chosen_nll=nll,
                             batch_count=real.sum(), lam=p.orpo_lambda)
      rewards = p.orpo_lambda * means
    return {"loss": loss, "rewards/chosen": rewards[:, 0], "rewards/rejected": rewards[:, 1],
            "rewards/accuracies": (rewards[:, 0] > rewards[:, 1]).astype(jnp.float32),
            "rewards/margins": rewards[:, 0] - rewards[:, 1], "logps/chosen": chosen,
            "logps/rejected": rejected}

  def loss(self, outputs: PairOutputs, batch: Batch) -> jax.Array:
    """Each pair's `config.preference.loss`; a mixture of experts adds its router losses."""
    loss = self.pair_terms(outputs, batch)["loss"]
    if outputs.router is not None:
      from models import moe
      router = moe.summarize(outputs.router)
      loss = loss + (self.config.moe.load_balance_weight * router["load_balance"]
                     + self.config.moe.router_z_weight * router["router_z"])
    return loss

  def _metric_values(self, outputs: PairOutputs, batch: Batch, mask=None) -> dict:
    """`pair_terms`, and each response's mean logit over the batch's response tokens (TRL's
    `logits/chosen` and `/rejected`: a sum over tokens over their count)."""
    values = self.pair_terms(outputs, batch)
    weights = batch[LOSS_WEIGHTS]
    if mask is not None:
      weights = weights * mask[:, None, None]
    totals = (outputs.mean_logits * weights).sum(axis=(0, 2)) / jnp.maximum(
        weights.sum(axis=(0, 2)), 1.0)
    pairs = weights.shape[0]  # Each pair carries the batch's figure (an eval mask drops none).
    values["logits/chosen"] = jnp.full((pairs,), totals[0])
    values["logits/rejected"] = jnp.full((pairs,), totals[1])
    return values

  def train_metrics(self, outputs: PairOutputs, batch: Batch, loss: jax.Array):
    values = {**self._metric_values(outputs, batch), "loss": loss}
    return PreferenceMetrics.single_from_model_output(**metrics_lib.outputs(values))

  def eval_metrics(self, outputs: PairOutputs, batch: Batch):
    values = self._metric_values(outputs, batch, mask=batch[MASK_KEY])
    return PreferenceMetrics.single_from_model_output(**metrics_lib.outputs(values),
                                                      mask=batch[MASK_KEY])

  def tokens_per_example(self, batch: Batch) -> int:
    """The real tokens of one pair's two sequences (a pair's share of the batch's)."""
    import numpy as np
    mask = np.asarray(batch[TARGET_MASK])
    return max(1, round(float(mask.sum()) / len(mask)))

  # -- The reference ------------------------------------------------------------------

  def create_train_state(self, *, params: PyTree, model_state: PyTree, rng: jax.Array):
    """A `PreferenceTrainState`, holding a copy of the initial weights under
    `reference="copy"`."""
    state = super().create_train_state(params=params, model_state=model_state, rng=rng)
    fields = {f.name: getattr(state, f.name) for f in dataclasses.fields(state) if f.init}
    reference = params if self.preference.reference == "copy" else None
    beta = jnp.asarray(self.preference.beta, jnp.float32) if self.sweep is not None else None
    return reference_lib.PreferenceTrainState(**fields, reference=reference, beta=beta)

  def _with_reference(self, state):
    """The state, its model state also holding the reference copy and a sweep's beta."""
    passed = {}
    if state.reference is not None:
      passed[reference_lib.REFERENCE] = state.reference
    if state.beta is not None:
      passed[reference_lib.BETA] = state.beta
    return state.replace(model_state={**state.model_state, **passed}) if passed else state

  @staticmethod
  def _without_reference(state):
    passed = (reference_lib.REFERENCE, reference_lib.BETA)
    return state.replace(model_state={k: v for k, v in state.model_state.items()
                                      if k not in passed})

  def train_step(self, state, batch: Batch):
    """One update; the reference copy reaches the loss through the step's model state."""
    new, outputs = self.steps.train(self._with_reference(state), batch)
    return self._without_reference(new), outputs

  def eval_step(self, state, batch: Batch):
    return self.steps.eval(self._with_reference(state), batch)

  def predict_step(self, state, batch: Batch):
    return self.steps.predict(self._with_reference(state), batch)

  def prediction(self, outputs: PairOutputs) -> jax.Array:
    """Each target token's probability under the policy, `[pairs, 2, length]` (what an
    ensemble averages)."""
    return jnp.exp(outputs.token_logps)

  def reference_logps_fn(self, state):
    """The compiled `(state, placed batch) -> [pairs, 2]` reference log-probs of the
    responses (the policy's own under `reference="precomputed"`: the pass before training)."""
    if self._reference_logps is None:
      def logps(state, batch):
        outputs = self.steps.eval_outputs(self._with_reference(state), batch)
        return self.strategy.whole_batch(outputs.ref_logps)
      self._reference_logps = self.strategy.compile_eval_step(logps, state)
    return self._reference_logps

  def precompute_reference(self, state, train_batches, *, num_steps: int,
                           workdir: str | None, eval_batches: list | None = None):
    """`(train batches, eval batches)` with the reference log-probs of each pair added
    (`trainer.preference.reference.precompute`) under `reference="precomputed"`; else
    both as they are."""
    if self.preference.reference != "precomputed":
      return train_batches, eval_batches
    return reference_lib.precompute(self, state, train_batches, num_steps=num_steps,
                                    workdir=workdir, eval_batches=eval_batches)
