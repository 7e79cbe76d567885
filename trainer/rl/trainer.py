"""`RLTrainer`: GRPO, Dr. GRPO and DAPO, each step's rollouts and updates in one program.

A subclass of `LanguageModelTrainer`. Its batches are prompts (`trainer.rl.data`). One
train step, compiled once under the training layout:

1. rollout: each prompt repeated `num_generations` (G) times, completions drawn by the
   project's `Generator` program from the current parameters, each row's key
   `fold_in(fold_in(state.rng, step), row)`, so a rerun draws the same completions;
2. rewards: the completions decoded and scored on the host (`jax.pure_callback`,
   `trainer.rl.rewards`); advantages within each prompt's group (`trainer.rl.losses`);
3. the completions' per-token log-probs under the current parameters (the "old"
   policy's) and, with `beta > 0`, the reference's, by the function the update uses;
4. `num_iterations` (μ) optimizer updates on those rollouts, each the Trainer's own
   train step (`steps.train`), the loss `config.rl.loss`.

The step counts as one (`state.step` advances by 1; the optimizer's own count by μ).
Because the old log-probs and the first update's are one function of one state, the
run is on-policy by construction; `on_policy_gap` (the largest difference between the
two, per step) measures it. Eval is a rollout too: held-out prompts' mean reward, one
completion each, sampled as the rollouts are (as TRL evaluates).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from clu import metrics as clu_metrics

from trainer import metrics as metrics_lib
from trainer.evaluation import MASK_KEY
from trainer.language_model import LanguageModelTrainer
from trainer.metrics import NanAverage
from trainer.preference import reference as reference_lib
from trainer.preference.losses import token_logps
from trainer.rl import data as rl_data
from trainer.rl import losses as losses_lib
from trainer.rl import multi_turn as multi_turn_lib
from trainer.rl import rewards as rewards_lib
from trainer.rl import samples as samples_lib
from trainer.rl import tools as tools_lib
from trainer.rl.data import PROMPT_IDS, PROMPT_LENGTHS, RECORD
from trainer.rl.settings import RL
from trainer.trainer import Batch

PyTree = Any
#: The update batch's keys beyond `inputs` and `targets`.
WEIGHTS, ADVANTAGES, OLD, REF, REWARD, EACH, CLIPPED, TOOLS = (
    "completion_weights", "advantages", "old_logps", "ref_logps", "rewards", "reward_each",
    "clipped", "tool_stats")


#: The train metrics every RL run logs, under TRL 1.16's names (`metric_names`).
TRAIN_METRICS = ("loss", "reward", "reward_std", "frac_reward_zero_std",
                 "completions/mean_length", "completions/min_length",
                 "completions/max_length", "completions/clipped_ratio",
                 "completions/mean_terminated_length", "entropy", "clip_ratio/low_mean",
                 "clip_ratio/high_mean", "clip_ratio/region_mean", "on_policy_gap")


#: A multi-turn run's tool metrics: TRL's calls per rollout and failures per call, and
#: the assistant turns per rollout.
TOOL_METRICS = ("tools/call_frequency", "tools/failure_frequency", "tools/turns")


def metric_names(rewards, *, kl: bool, tools: bool = False) -> tuple[str, ...]:
  """A run's train metrics: `TRAIN_METRICS`, each reward function's mean and std
  (`rewards/<name>/mean`, `/std`), `kl` with `beta > 0`, and `TOOL_METRICS` with tools."""
  each = tuple(f"rewards/{r.name}/{stat}" for r in rewards for stat in ("mean", "std"))
  return TRAIN_METRICS + each + (("kl",) if kl else ()) + (TOOL_METRICS if tools else ())


def _masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
  return (x * mask).sum() / jnp.maximum(mask.sum(), 1.0)


class RLTrainer(LanguageModelTrainer):
  """RL with verifiable rewards on `language_model(**config.model)` (module docstring).

  Attributes:
    rl: `config.rl`, checked before anything is built.
    rewards: the reward functions `config.rl.rewards` names.
  """

  def __init__(self, config: ml_collections.ConfigDict, **kwargs):
    self.rl = RL.from_config(config)  # Refused before any compute.
    self.toolbox = tools_lib.load(tuple(config.rl.tools),
                                  config.rl.environment or None)
    rewarded = self.toolbox is not None and self.toolbox.rewarded
    self.rewards = (rewards_lib.load(tuple(config.rl.rewards), tuple(config.rl.reward_weights))
                    if config.rl.rewards or not rewarded else [])
    if rewarded:  # The environment's get_reward: one more reward (TRL's).
      self.rewards.append(multi_turn_lib.environment_reward(self.toolbox))
    super().__init__(config, **kwargs)
    from trainer.generation import Generator, Sampling
    self.generator = Generator.from_trainer(self)
    if config.strategy.name != "sharded_ensemble":  # A sweep: each member's step generates.
      try:
        self.generator.check_layout()
      except ValueError as e:
        raise ValueError(f"{e} RL generates its rollouts in the train step: it runs under "
                         f"single_device, sharded_data_parallel (data, fsdp, tensor axes) "
                         f"or, for a sweep, sharded_ensemble.") from None
    self._tokenizer = None
    stop = self._eos_id()
    self.sampling = Sampling(max_new_tokens=self.rl.max_completion_length,
                             temperature=self.rl.temperature, top_k=config.rl.top_k,
                             top_p=config.rl.top_p, stop_tokens=() if stop is None else (stop,),
                             pad_id=0 if stop is None else stop)
    #: The multi-turn rollouts with tools (`trainer.rl.multi_turn`); None: one turn.
    self.multi_turn = (multi_turn_lib.build(self) if self.toolbox is not None
                       and stop is not None else None)
    self.metric_names = metric_names(self.rewards, kl=self.rl.beta > 0,
                                     tools=self.multi_turn is not None)
    self._metrics = metrics_lib.collection_of(
        {**{n: NanAverage for n in self.metric_names if n != "on_policy_gap"},
         "on_policy_gap": clu_metrics.LastValue})
    #: The latest train rollout's first rows (`CompletionSamples` writes them).
    self.samples = samples_lib.Samples(config.rl.log_completions)
    self._check_rewards()

  def _check_rewards(self) -> None:
    """Each reward called once on the first batch of prompts the run reads (with empty
    completions), before anything compiles (`trainer.rl.rewards.check`)."""
    if not self.config.data.sources:
      return
    prompts = rl_data.from_config(self.config, epochs=1)()
    try:
      batch = next(prompts)
    except StopIteration:
      return
    finally:
      prompts.close()
    records = rl_data.records_of(batch[RECORD])
    environments = None
    if self.toolbox is not None and self.toolbox.environment is not None:
      environments = [self.toolbox.new_environment() for _ in records]
      for seed, (environment, record) in enumerate(zip(environments, records, strict=True)):
        self.toolbox.reset(environment, record, seed)
    rewards_lib.check(self.rewards, records, prompt_field=self.config.rl.prompt_field,
                      prompt_ids=self._prompt_lists(batch[PROMPT_IDS], batch[PROMPT_LENGTHS]),
                      environments=environments)

  def default_actions(self, *, checkpointer, eval_batches, workdir, writer=None):
    """The Trainer's, and the sample completions every `config.log_every_steps`
    (`trainer.rl.samples`) where a writer is given."""
    actions = super().default_actions(checkpointer=checkpointer, eval_batches=eval_batches,
                                      workdir=workdir, writer=writer)
    if writer is not None and self.samples.rows and self.config.log_every_steps:
      actions.append(samples_lib.CompletionSamples(writer, self.samples,
                                                   every_steps=self.config.log_every_steps))
    return actions

  @property
  def tokenizer(self):
    """The run's tokenizer (`config.data.tokenizer`, else the model directory's), which
    decodes the completions for the rewards."""
    if self._tokenizer is None:
      from trainer.data.lm import tokenizer_of
      self._tokenizer = tokenizer_of(self.config)
    return self._tokenizer

  def _eos_id(self) -> int | None:
    """The EOS id that ends a completion (None: no tokenizer named yet, as in a dry run)."""
    if not (self.config.data.tokenizer or self.config.init_from.path):
      return None
    return self.tokenizer.eos_id

  # -- The model's call --------------------------------------------------------------

  def model_inputs(self, batch: Batch, *, train: bool, rngs) -> tuple[tuple, dict]:
    """The update batch's tokens (a prompt batch's prompts, at init)."""
    del train, rngs
    return ((batch["inputs"] if "inputs" in batch else batch[PROMPT_IDS]),), {}

  def logps(self, params, model_state, inputs, targets) -> jax.Array:
    """Each target's log-prob under `params`: the one function the rollout's old log-probs,
    the reference's and the update's come from."""
    outputs, _ = self.apply_model(params, model_state, {"inputs": inputs},
                                  rngs=self.step_rngs(jax.random.PRNGKey(0)), train=False)
    logits = outputs.logits if hasattr(outputs, "logits") else outputs
    return token_logps(logits, targets, self.config.model.vocab_size)

  def loss(self, outputs, batch: Batch) -> jax.Array:
    """Each completion's `config.rl.loss` (its mean over the batch is the loss)."""
    return self._terms(outputs, batch)[0]

  def _terms(self, outputs, batch):
    rl = self.rl
    logits = outputs.logits if hasattr(outputs, "logits") else outputs
    logps = token_logps(logits, batch["targets"], self.config.model.vocab_size)
    per_token = losses_lib.per_token_loss(
        logps, batch[OLD], batch[ADVANTAGES], epsilon=rl.epsilon, epsilon_high=rl.epsilon_high,
        ref_logps=batch.get(REF), beta=rl.beta)
    mask = batch[WEIGHTS]
    loss = losses_lib.per_sequence(per_token, mask, rl.loss,
                                   max_completion_length=rl.max_completion_length)
    return loss, logps, mask

  def train_metrics(self, outputs, batch: Batch, loss: jax.Array):
    """TRL 1.16's GRPO metrics (`metric_names`), of the step's rollouts and its first
    update, and `on_policy_gap`: the largest difference between the rollout's log-probs and
    the first update's."""
    rl = self.rl
    _, logps, mask = self._terms(outputs, batch)
    logits = outputs.logits if hasattr(outputs, "logits") else outputs
    logits = logits[..., :self.config.model.vocab_size].astype(jnp.float32)
    log_p = jax.nn.log_softmax(logits, axis=-1)
    entropy = -(jnp.exp(log_p) * log_p).sum(-1)
    ratio = jnp.exp(logps - batch[OLD])
    adv = batch[ADVANTAGES][:, None]
    low = ((ratio < 1.0 - rl.epsilon) & (adv < 0)).astype(jnp.float32)
    high = ((ratio > 1.0 + rl.epsilon_high) & (adv > 0)).astype(jnp.float32)
    reward = batch[REWARD]
    lengths = mask.sum(-1)
    clipped = batch[CLIPPED]
    group_std = jnp.nanstd(reward.reshape(-1, rl.num_generations), axis=1, ddof=1)
    terminated = jnp.sum(lengths * (1 - clipped)) / jnp.maximum(jnp.sum(1 - clipped), 1.0)
    values = {
        "loss": loss, "reward": jnp.nanmean(reward), "reward_std": jnp.nanstd(reward, ddof=1),
        "frac_reward_zero_std": jnp.mean(jnp.isclose(group_std, 0.0)),
        "completions/mean_length": lengths.mean(), "completions/min_length": lengths.min(),
        "completions/max_length": lengths.max(), "completions/clipped_ratio": clipped.mean(),
        "completions/mean_terminated_length": terminated,
        "entropy": _masked_mean(entropy, mask), "clip_ratio/low_mean": _masked_mean(low, mask),
        "clip_ratio/high_mean": _masked_mean(high, mask),
        "clip_ratio/region_mean": _masked_mean(jnp.maximum(low, high), mask),
        "on_policy_gap": jnp.max(jnp.abs(logps - batch[OLD]) * mask)}
    for i, r in enumerate(self.rewards):
      column = batch[EACH][:, i]
      values[f"rewards/{r.name}/mean"] = jnp.nanmean(column)
      values[f"rewards/{r.name}/std"] = jnp.nanstd(column, ddof=1)
    if REF in batch:
      delta = batch[REF] - logps
      values["kl"] = _masked_mean(jnp.exp(delta) - delta - 1.0, mask)
    if TOOLS in batch:
      calls, failures, turns = (batch[TOOLS][:, i] for i in range(3))
      values["tools/call_frequency"] = calls.mean()
      values["tools/failure_frequency"] = failures.sum() / jnp.maximum(calls.sum(), 1.0)
      values["tools/turns"] = turns.mean()
    return self._metrics.single_from_model_output(**metrics_lib.outputs(values))

  def tokens_per_example(self, batch: Batch) -> int:
    """A prompt's tokens and its G completions' budget."""
    return int(self.rl.max_prompt_length + self.rl.num_generations
               * self.rl.max_completion_length)

  # -- The state and its reference ------------------------------------------------------

  def create_train_state(self, *, params: PyTree, model_state: PyTree, rng: jax.Array):
    state = super().create_train_state(params=params, model_state=model_state, rng=rng)
    fields = {f.name: getattr(state, f.name) for f in dataclasses.fields(state) if f.init}
    return reference_lib.PreferenceTrainState(
        **fields, reference=params if self.rl.reference == "copy" else None)

  # -- The dry run (`trainer.plan`) -----------------------------------------------------

  def example_update(self) -> Batch:
    """A host batch of `update_batch`'s shapes (zeros): a step's rollouts, all rows. (The
    step's own trace would need the strategy's axes under an ensemble.)"""
    rl = self.rl
    rows, width = self.config.batch_size * rl.num_generations, (
        rl.max_prompt_length + rl.max_completion_length - 1)
    tokens, values = np.zeros((rows, width), np.int32), np.zeros((rows, width), np.float32)
    batch = {"inputs": tokens, "targets": tokens, WEIGHTS: values, OLD: values,
             ADVANTAGES: np.zeros((rows,), np.float32), REWARD: np.zeros((rows,), np.float32),
             EACH: np.zeros((rows, len(self.rewards)), np.float32),
             CLIPPED: np.zeros((rows,), np.float32)}
    if self.multi_turn is not None:
      batch[TOOLS] = np.zeros((rows, len(multi_turn_lib.STATS)), np.float32)
    return {**batch, REF: values} if rl.reference != "none" else batch

  def plan_notes(self, abstract_state) -> list[str]:
    """The dry run's lines for the step's two parts, per device: the rollout's key/value
    cache and one update's temporaries, each compiled or traced on its own."""
    from strategies.base import cpu_compiler_options
    from strategies.capabilities import Ensemble
    from trainer.generation import cache_bytes
    from trainer.plan import CPU_PLAN_COMPILER_OPTIONS
    rl, strategy = self.rl, self.strategy
    rows = self.config.batch_size * rl.num_generations
    slots = rl.max_prompt_length + rl.max_completion_length
    if self.toolbox is not None:  # Room for the widest tool turn (`trainer.rl.multi_turn`).
      slots += multi_turn_lib.MultiTurn.widths(rl.max_completion_length)[-1] + 1
    if isinstance(strategy, Ensemble):  # One member's cache, times the members a device holds.
      member = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype),
                            abstract_state)
      one, _ = cache_bytes(self, member, rows, slots)
      total = one * strategy.num_members
      per_device = one * strategy.members_per_device // strategy.num_data_replicas
    else:
      total, per_device = cache_bytes(self, abstract_state, rows, slots)
    batch = strategy.put_batch(self.example_update())
    devices = {d for x in jax.tree.leaves(batch) for d in x.sharding.device_set}
    update = strategy.compile_train_step(self.steps.train, abstract_state).lower(
        abstract_state, batch).compile(cpu_compiler_options(devices, CPU_PLAN_COMPILER_OPTIONS))
    temps = int(update.memory_analysis().temp_size_in_bytes)
    mib = lambda b: f"{b / 2**20:,.2f} MiB"  # noqa: E731
    return [f"  rollout cache     {mib(per_device)} ({rows} rows x {slots} positions; "
            f"{mib(total)} in all)",
            f"  update alone      {mib(temps)} temporaries ({rows} rows, {rl.num_iterations} "
            f"a step); the step's temporaries hold both parts"]

  # -- The rollout -------------------------------------------------------------------------

  @staticmethod
  def _prompt_lists(prompt_ids, prompt_lengths) -> list[list[int]]:
    return [p[:n].tolist() for p, n in zip(np.asarray(prompt_ids), np.asarray(prompt_lengths),
                                            strict=True)]

  def _host_rewards(self, prompt_ids, prompt_lengths, records, new, counts, step,
                    handle=None, *, group: int, keep: bool = False):
    """The rewards of a rollout's completions (`trainer.rl.rewards`), on the host: each
    group's prompt record (its prompt's ids decoded where the batch holds no records).
    With `handle`, a multi-turn rollout's: its conversations and environments are
    closed (`trainer.rl.multi_turn.closed`) and their tool statistics returned too."""
    decode = self.tokenizer.tokenizer.decode_batch
    episodes = stats = None
    if handle is not None:
      episodes, stats = multi_turn_lib.closed(self.multi_turn.episodes, int(handle), new,
                                              counts)
    prompts = self._prompt_lists(prompt_ids, prompt_lengths)
    completions = [c[:n].tolist() for c, n in zip(np.asarray(new), np.asarray(counts),
                                                  strict=True)]
    if records is None:
      field = self.config.rl.prompt_field
      records = [{field: text} for text in decode(prompts[::group], skip_special_tokens=True)]
      real = np.ones(len(prompts), bool)
    else:  # An eval batch's padding rows hold no record: they are not scored (NaN).
      real = np.repeat(np.asarray(records).any(axis=-1), group)
      records = rl_data.records_of(np.asarray(records)[np.asarray(records).any(axis=-1)])
    rows = np.flatnonzero(real)
    totals = np.full((len(prompts),), np.nan, np.float32)
    values = np.full((len(prompts), len(self.rewards)), np.nan, np.float32)
    done = (lambda out: out) if stats is None else (lambda out: (*out, stats))  # noqa: E731
    if not len(rows):
      return done((totals, values))
    kwargs = rewards_lib.arguments(
        [r for r in records for _ in range(group)],
        decode([completions[i] for i in rows], skip_special_tokens=True),
        prompt_field=self.config.rl.prompt_field, prompt_ids=[prompts[i] for i in rows],
        completion_ids=[completions[i] for i in rows], step=int(step),
        max_steps=self.num_train_steps,
        messages=None if episodes is None else [episodes[i].messages for i in rows],
        environments=None if episodes is None or self.toolbox.environment is None else [
            episodes[i].environment for i in rows])
    total, each = rewards_lib.score(self.rewards, kwargs)
    if keep:
      self.samples.keep(step, kwargs["prompts"], kwargs["completions"], total, each)
    totals[rows] = total
    values[rows] = np.asarray([each[r.name] for r in self.rewards], np.float32).T.reshape(
        len(rows), len(self.rewards))
    return done((totals, values))

  def rollout(self, state, batch: Batch, *, group: int, sampling, keep: bool = False
              ) -> dict[str, jax.Array]:
    """Completions of each prompt (`group` each), their rewards and the update's batch;
    `ok` is False once a reward function has failed (`trainer.step.host_calls`). `keep`:
    the first rows are kept as samples (`self.samples`)."""
    prompts = jnp.repeat(batch[PROMPT_IDS], group, axis=0)
    lengths = jnp.maximum(jnp.repeat(batch[PROMPT_LENGTHS], group, axis=0), 1)
    rows = prompts.shape[0]
    step_key = jax.random.fold_in(state.rng, state.step)  # Row i: fold_in(step's key, i),
    ids = self.strategy.replica_rows(  # i the row's index in the global batch.
        jnp.arange(rows * (self.strategy.num_data_replicas
                           if self.strategy.step_sees_batch_shard else 1)))
    keys = jax.vmap(lambda i: jax.random.fold_in(step_key, i))(ids)
    shapes = (jax.ShapeDtypeStruct((rows,), jnp.float32),
              jax.ShapeDtypeStruct((rows, len(self.rewards)), jnp.float32))
    host = functools.partial(self._host_rewards, group=group, keep=keep)
    extra = {}
    if self.multi_turn is None:
      new, counts, stopped = self.generator.program(sampling)(
          state, {"tokens": prompts, "lengths": lengths, "keys": keys})
      (total, each), ok = self.compiled.host_calls.call(host, shapes, prompts, lengths,
                                                        batch.get(RECORD), new, counts,
                                                        state.step)
    else:  # Tools: the prompts rendered on the host, turns continued from the cache.
      rendered, started = self.multi_turn.prompts(batch[RECORD], group=group, step=state.step,
                                                  rows=ids)
      prompts, lengths = rendered["tokens"], rendered["lengths"]
      new, counts, stopped, tool, looped = self.multi_turn.program()(
          state, {**rendered, "keys": keys})
      shapes += (jax.ShapeDtypeStruct((rows, len(multi_turn_lib.STATS)), jnp.float32),)
      (total, each, stats), ok = self.compiled.host_calls.call(
          host, shapes, prompts, lengths, batch.get(RECORD), new, counts, state.step,
          rendered[multi_turn_lib.HANDLE])
      ok = ok & started & looped
      extra = {TOOLS: stats, "tool_mask": tool}
    # Each row: its prompt's tokens, then its completion's, then padding.
    from trainer.generation import joined
    tokens, weights, at = joined(prompts, lengths, new, counts, self.sampling.pad_id)
    if "tool_mask" in extra:  # Tool-turn tokens are in the sequence but weigh 0.
      tool = jnp.take_along_axis(extra.pop("tool_mask"), at, axis=1)[:, 1:]
      weights = weights * (1.0 - tool.astype(jnp.float32))
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], WEIGHTS: weights,
            REWARD: total, EACH: each, CLIPPED: (~stopped).astype(jnp.float32), "ok": ok,
            **extra}

  def update_batch(self, state, batch: Batch) -> Batch:
    """A prompt batch's rollouts as the updates' batch: the completions (`rollout`), their
    advantages, and their old and (with `beta > 0`) reference log-probs."""
    rl = self.rl
    update = dict(jax.lax.stop_gradient(self.rollout(state, batch, group=rl.num_generations,
                                                     sampling=self.sampling, keep=True)))
    # A failed reward call makes the update non-finite: no action that reads the state
    # sees it, and the loop raises the reward's error (`trainer.step.host_calls`).
    update[ADVANTAGES] = jnp.where(update.pop("ok"), losses_lib.group_advantages(
        update[REWARD], rl.num_generations, scale=rl.scale_rewards), jnp.nan)
    update[OLD] = jax.lax.stop_gradient(self.logps(state.params, state.model_state,
                                                   update["inputs"], update["targets"]))
    if rl.reference != "none":
      weights = (state.reference if rl.reference == "copy"
                 else reference_lib.adapters_off(state.params))
      update[REF] = jax.lax.stop_gradient(self.logps(weights, state.model_state,
                                                     update["inputs"], update["targets"]))
    return update

  def train_step(self, state, batch: Batch):
    """One RL step: rollouts, rewards, old and reference log-probs, μ updates."""
    update = self.update_batch(state, batch)
    step = state.step
    state, outputs = self.steps.train(state, update)
    for _ in range(self.rl.num_iterations - 1):
      state, _ = self.steps.train(state, update)
    return state.replace(step=step + 1), outputs

  def eval_step(self, state, batch: Batch):
    """Held-out prompts' rewards: one completion each, sampled as the rollouts are (as TRL
    evaluates), its key the step's and the row's (`reward`, and each function's
    `rewards/<name>/mean`, over the completions it applies to)."""
    out = self.rollout(state, batch, group=1, sampling=self.sampling)
    values = {"reward": out[REWARD], **{f"rewards/{r.name}/mean": out[EACH][:, i]
                                        for i, r in enumerate(self.rewards)}}
    collection = metrics_lib.collection_of(dict.fromkeys(values, NanAverage))
    return self.strategy.merge_metrics_over_data(
        collection.single_from_model_output(**metrics_lib.outputs(values), mask=batch[MASK_KEY]))

  def predict_step(self, state, batch: Batch):
    """Each held-out prompt's reward of its completion (sampled as in `eval_step`)."""
    return self.strategy.whole_batch(self.rollout(state, batch, group=1,
                                                  sampling=self.sampling)[REWARD])
