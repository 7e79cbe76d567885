"""`DistillationTrainer`: on-policy distillation, the student's samples and the teacher's
distributions in one program.

A subclass of `LanguageModelTrainer` (the student: any model the fine-tune trains, LoRA
and QLoRA included). Its batches are prompts with, optionally, the records' completions
(`trainer.distill.data`). One train step, compiled once under the training layout:

1. completions: with probability `config.distill.lmbda` (GKD's; a draw from the step's
   key), the student's own samples, drawn by the project's `Generator` from the current
   parameters at `config.distill.temperature`, row i's key
   `fold_in(fold_in(state.rng, step), i)`; otherwise the records' completions;
2. the teacher's log-probs of every completion token (`trainer.distill.teacher`, frozen);
3. one update of the student on the divergence (`trainer.distill.losses`) over the
   completion tokens, the batch's sum divided by its completion tokens (TRL's).

The sampler's and the update's student log-probs come from one model function (the
Generator decodes with the same variables the update differentiates).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections

from trainer import metrics as metrics_lib
from trainer.distill import losses as losses_lib
from trainer.distill import teacher as teacher_lib
from trainer.distill.data import COMPLETION_IDS, COMPLETION_LENGTHS
from trainer.distill.settings import Distill
from trainer.evaluation import MASK_KEY
from trainer.generation import logits_of
from trainer.language_model import LanguageModelTrainer
from trainer.metrics import NanAverage
from trainer.rl.data import PROMPT_IDS, PROMPT_LENGTHS
from trainer.run.state import States
from trainer.step.train_state import EmaTrainState
from trainer.trainer import Batch

PyTree = Any
#: The update batch's keys beyond `inputs` and `targets`.
WEIGHTS, TEACHER, ON_POLICY, CLIPPED = ("completion_weights", "teacher_logps", "on_policy",
                                        "clipped")
#: A sweep's per-member beta, a row each in the update batch.
BETA = "distill_beta"

#: What every distillation step logs: the divergence, the student's entropy at the
#: temperature (TRL's `entropy`), the share of on-policy batches and the completions'
#: lengths (TRL's names).
TRAIN_METRICS = ("loss", "entropy", "on_policy", "completions/mean_length",
                 "completions/clipped_ratio")
#: Held-out: the divergence and entropy on the completions the step would train on, the
#: reverse KL (T = 1) to the teacher on the student's own samples, and the student's
#: negative log-likelihood of the records' completions.
EVAL_METRICS = ("loss", "entropy", "reverse_kl", "nll")


class DistillTrainState(EmaTrainState):
  """The student's train state, the frozen teacher's parameters beside it, and under a
  sweep the divergence's beta as an array (each member's own)."""

  teacher: Any = None
  beta: Any = None


class TeacherStates(States):
  """`States` whose new state also holds the teacher's weights, read from its source
  (`Teacher.load`); a restored state holds them already (the checkpoint's)."""

  teacher: teacher_lib.Teacher

  @classmethod
  def of(cls, states: States, teacher: teacher_lib.Teacher) -> TeacherStates:
    out = cls.__new__(cls)
    out.__dict__.update(states.__dict__)
    out.teacher = teacher
    return out

  def init(self, example_batch: Batch, rng: jax.Array | None = None) -> PyTree:
    state = super().init(example_batch, rng)
    return self.teacher.load(state, self.strategy, self.abstract(example_batch))

  def init_members(self, seeds: list[int]) -> PyTree:
    raise NotImplementedError("new members during a run (refused with the config: "
                              "DistillationTrainer)")


def _masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
  return (x * mask).sum() / jnp.maximum(mask.sum(), 1.0)


class DistillationTrainer(LanguageModelTrainer):
  """On-policy distillation of `config.distill.teacher` into `language_model(**config.model)`
  (module docstring).

  Attributes:
    distill: `config.distill`, checked before anything is built.
    teacher: the frozen teacher (`trainer.distill.teacher.Teacher`).
  """

  def __init__(self, config: ml_collections.ConfigDict, **kwargs):
    self.distill = Distill.from_config(config)  # Refused before any compute.
    super().__init__(config, **kwargs)
    from trainer.sweep.members import REFILLING
    if self.sweep is not None and self.sweep.scheduler in REFILLING:
      raise ValueError(f"config.sweep.scheduler={config.sweep.scheduler!r} (or a study) starts "
                       f"new members during the run; distillation's teacher is read once, "
                       f"when the run starts: sweep it on a grid (config.sweep.grid).")
    self.teacher = teacher_lib.Teacher.from_config(
        config, vocab_multiple=self.strategy.shards_of("vocab"))
    self.states = TeacherStates.of(self.states, self.teacher)
    self.runner = dataclasses.replace(self.runner, states=self.states)
    from trainer.data.lm import tokenizer_of
    from trainer.generation import Generator, Sampling
    self.generator = Generator.from_trainer(self)
    if self.distill.lmbda > 0 and config.strategy.name != "sharded_ensemble":
      try:
        self.generator.check_layout()
      except ValueError as e:
        raise ValueError(f"{e} With config.distill.lmbda={self.distill.lmbda} the student "
                         f"samples in the train step: use single_device or "
                         f"sharded_data_parallel (data, fsdp, tensor axes), or lmbda=0."
                         ) from None
    stop = (tokenizer_of(config).eos_id if config.data.tokenizer or config.init_from.path
            else None)
    self.sampling = Sampling(max_new_tokens=self.distill.max_completion_length,
                             temperature=self.distill.temperature, top_k=config.distill.top_k,
                             top_p=config.distill.top_p,
                             stop_tokens=() if stop is None else (stop,),
                             pad_id=0 if stop is None else stop)
    self._train_metrics = metrics_lib.collection_of(dict.fromkeys(TRAIN_METRICS, NanAverage))
    self._eval_metrics = metrics_lib.collection_of(dict.fromkeys(EVAL_METRICS, NanAverage))

  # -- The model's call and the loss ---------------------------------------------------

  def model_inputs(self, batch: Batch, *, train: bool, rngs) -> tuple[tuple, dict]:
    """The update batch's tokens (a batch of prompts', at init)."""
    del train, rngs
    return ((batch["inputs"] if "inputs" in batch else batch[PROMPT_IDS]),), {}

  def _terms(self, outputs, batch: Batch):
    """Each token's divergence and entropy, and the student's log-probs at T; a sweep's
    beta is each member's own (the update batch's `BETA` rows)."""
    student = losses_lib.log_probs(logits_of(outputs), self.distill.temperature,
                                   self.config.model.vocab_size)
    beta = batch[BETA][:, None] if BETA in batch else self.distill.beta
    per_token = losses_lib.divergence(student, batch[TEACHER], beta)
    return per_token, losses_lib.entropy(student), student

  def loss(self, outputs, batch: Batch) -> jax.Array:
    """Each row's share of the batch's divergence summed over completion tokens and
    divided by their count (TRL 1.16's reduction)."""
    per_token, _, _ = self._terms(outputs, batch)
    mask = batch[WEIGHTS]
    # A step that sees a shard of the batch (a sweep's member) divides by the mean of the
    # shards' counts: averaged over the shards, its rows' mean is the batch's sum / count.
    count = self.strategy.mean_over_data(mask.sum())
    return losses_lib.per_sequence(per_token, mask, count=count)

  def train_metrics(self, outputs, batch: Batch, loss: jax.Array):
    _, entropy, _ = self._terms(outputs, batch)
    mask = batch[WEIGHTS]
    values = {"loss": loss, "entropy": _masked_mean(jax.lax.stop_gradient(entropy), mask),
              "on_policy": batch[ON_POLICY].mean(),
              "completions/mean_length": mask.sum(-1).mean(),
              "completions/clipped_ratio": batch[CLIPPED].mean()}
    return self._train_metrics.single_from_model_output(**metrics_lib.outputs(values))

  def tokens_per_example(self, batch: Batch) -> int:
    """A row's prompt and completion budget."""
    return int(self.distill.max_prompt_length + self.distill.max_completion_length)

  # -- The state and its teacher --------------------------------------------------------

  def create_train_state(self, *, params: PyTree, model_state: PyTree, rng: jax.Array):
    """A `DistillTrainState` holding the teacher's variables (made fresh by its own init,
    laid out as the student's are; `TeacherStates` reads the real ones)."""
    state = super().create_train_state(params=params, model_state=model_state, rng=rng)
    fields = {f.name: getattr(state, f.name) for f in dataclasses.fields(state) if f.init}
    beta = jnp.asarray(self.distill.beta, jnp.float32) if self.sweep is not None else None
    return DistillTrainState(**fields, teacher=self.teacher.init(jax.random.PRNGKey(0)),
                             beta=beta)

  # -- The step --------------------------------------------------------------------------

  def completions(self, state, batch: Batch, *, on_policy: jax.Array | bool
                  ) -> dict[str, jax.Array]:
    """The rows' completions: the student's samples where `on_policy`, else the records';
    as the update's `inputs`, `targets` and weights."""
    prompts, lengths = batch[PROMPT_IDS], jnp.maximum(batch[PROMPT_LENGTHS], 1)
    rows = prompts.shape[0]
    step_key = jax.random.fold_in(state.rng, state.step)
    ids = self.strategy.replica_rows(  # Row i's key: i its index in the global batch.
        jnp.arange(rows * (self.strategy.num_data_replicas
                           if self.strategy.step_sees_batch_shard else 1)))
    keys = jax.vmap(lambda i: jax.random.fold_in(step_key, i))(ids)

    def sampled(active=True):
      return self.generator.program(self.sampling)(
          state, {"tokens": prompts, "lengths": lengths, "keys": keys, "active": active})

    def recorded():
      counts = batch[COMPLETION_LENGTHS]
      new = batch[COMPLETION_IDS]
      last = jnp.take_along_axis(new, jnp.maximum(counts - 1, 0)[:, None], axis=1)[:, 0]
      stopped = jnp.isin(last, jnp.asarray(self.sampling.stop_tokens or (-1,), jnp.int32))
      return new, counts, stopped & (counts > 0)

    if isinstance(on_policy, bool):
      new, counts, stopped = sampled() if on_policy else recorded()
    else:  # Both, the sampler's loop running no step off-policy (no collective in a cond).
      new, counts, stopped = jax.tree.map(lambda a, b: jnp.where(on_policy, a, b),
                                          sampled(on_policy), recorded())
    from trainer.generation import joined
    tokens, weights, _ = joined(prompts, lengths, new, counts, self.sampling.pad_id)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], WEIGHTS: weights,
            CLIPPED: (~stopped).astype(jnp.float32)}

  def teacher_logps(self, state, tokens: jax.Array, temperature: float | None = None
                    ) -> jax.Array:
    """The teacher's log-probs `[rows, length, vocab]` at `temperature` (None: the run's)."""
    logits = self.strategy.bind_batch_axis(
        lambda t: self.teacher.logits(state.teacher, t), tokens)
    return losses_lib.log_probs(logits, self.distill.temperature if temperature is None
                                else temperature, self.config.model.vocab_size)

  def _on_policy(self, state) -> jax.Array | bool:
    lmbda = self.distill.lmbda
    if lmbda in (0.0, 1.0):
      return lmbda == 1.0
    key = jax.random.fold_in(jax.random.fold_in(state.rng, state.step), 0x6B64)  # "kd"
    return jax.random.uniform(key) < lmbda

  def update_batch(self, state, batch: Batch, on_policy: bool | None = None) -> Batch:
    """A batch of prompts as the update's batch: completions and the teacher's log-probs;
    `on_policy` whether the completions are the student's (None: the step's draw)."""
    on = self._on_policy(state) if on_policy is None else on_policy
    update = dict(jax.lax.stop_gradient(self.completions(state, batch, on_policy=on)))
    update[TEACHER] = jax.lax.stop_gradient(self.teacher_logps(state, update["inputs"]))
    rows = update["inputs"].shape[0]
    update[ON_POLICY] = jnp.full((rows,), on, jnp.float32)
    if state.beta is not None:
      update[BETA] = jnp.full((rows,), state.beta, jnp.float32)
    return update

  def train_step(self, state, batch: Batch):
    """Completions, the teacher's log-probs, one update."""
    return self.steps.train(state, self.update_batch(state, batch))

  def _student(self, state, update: Batch):
    outputs, _ = self.apply_model(state.params, state.model_state, update,
                                  rngs=self.step_rngs(jax.random.PRNGKey(0)), train=False)
    return logits_of(outputs)

  def eval_step(self, state, batch: Batch):
    """Held-out records: the divergence and entropy on the completions a train step would
    use (the student's samples where lmbda > 0, else the records'), the reverse KL at T = 1
    on those completions, and the student's NLL of the records' completions."""
    mask = batch[MASK_KEY]
    update = self.update_batch(state, batch, on_policy=self.distill.lmbda > 0)
    logits = self._student(state, update)
    per_token, entropy, _ = self._terms(logits, update)
    weights = update[WEIGHTS] * mask[:, None]

    def each(value):  # The batch's figure on every row (padding rows are masked).
      return jnp.full(mask.shape, value)
    plain = losses_lib.log_probs(logits, 1.0, self.config.model.vocab_size)
    teacher = (update[TEACHER] if self.distill.temperature == 1.0
               else self.teacher_logps(state, update["inputs"], 1.0))
    values = {"loss": each(_masked_mean(per_token, weights)),
              "entropy": each(_masked_mean(entropy, weights)),
              "reverse_kl": each(_masked_mean(losses_lib.divergence(plain, teacher, 1.0),
                                              weights))}
    records = self.completions(state, batch, on_policy=False)
    from trainer.preference.losses import token_logps
    logps = token_logps(self._student(state, records), records["targets"],
                        self.config.model.vocab_size)
    weights = records[WEIGHTS] * mask[:, None]
    values["nll"] = each(jnp.where(weights.sum() > 0, -_masked_mean(logps, weights), jnp.nan))
    return self.strategy.merge_metrics_over_data(self._eval_metrics.single_from_model_output(
        **metrics_lib.outputs(values), mask=mask))

  def predict_step(self, state, batch: Batch):
    """Each row's mean divergence over its completion (as the eval computes it)."""
    update = self.update_batch(state, batch)
    per_token, _, _ = self._terms(self._student(state, update), update)
    weights = update[WEIGHTS]
    return self.strategy.whole_batch((per_token * weights).sum(-1) / jnp.maximum(
        weights.sum(-1), 1.0))

  # -- The dry run (`trainer.plan`) -------------------------------------------------------

  def plan_notes(self, abstract_state) -> list[str]:
    """The dry run's line for the teacher's bytes per device."""
    placed = self.strategy.checkpoint_target(abstract_state)
    total, per_device = teacher_lib.teacher_bytes(placed.teacher)
    mib = lambda b: f"{b / 2**20:,.2f} MiB"  # noqa: E731
    kind = self.distill.teacher_dtype or "its own dtype"
    return [f"  teacher           {mib(per_device)} ({self.teacher.fields['family']}, "
            f"{kind}; {mib(total)} in all)"]

