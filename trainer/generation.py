"""Text from a trained state: prefill and decode with a key/value cache, one compiled program.

    from trainer.generation import Generator, Sampling
    generator = Generator.from_trainer(trainer)          # or Generator(model_variables, ...)
    out = generator(state, [[1, 5, 9], [1, 7]], Sampling(max_new_tokens=32, top_p=0.9))
    out.tokens      # each prompt's new tokens (up to and including a stop token)

The prompts, of different lengths, are right-padded into one batch. One program
(compiled by the strategy, so under the layout the state was trained in) runs the
prefill, which writes every prompt token's keys and values into the model's cache
(`models.kv_cache`), then a `lax.while_loop` of decode steps: each row's next
token is chosen from the logits at its own last position, fed back at the next
position, and written at its own cache index, until `max_new_tokens` or until every
row has produced a stop token. Nothing returns to the host in between.

Choosing a token (`Sampling`): greedy when `temperature` is 0, else a draw from the
softmax of the logits divided by `temperature`, restricted to the `top_k` largest
(0: all) and to the smallest set whose probability reaches `top_p` (HF's order:
temperature, top-k, top-p). Row `i`'s draw at step `t` uses `fold_in(key_i, t)` with
`key_i` the `i`-th of `split(PRNGKey(seed), rows)`, so a seed gives the same tokens
under every layout.

The model must take `(tokens, positions=...)` and return logits (or an output with a
`logits` field, as a mixture of experts' `MoeOutput`), and keep a cache: the
project's families do (`TransformerLM`, `GPT2LM`, `LlamaLM` and every family on it).
Layouts that split what the cache holds whole are refused before anything runs:
an ensemble (pick a member's state), a pipeline (`stage`), a context axis, or a
strategy that steps per device (`pmap`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models import kv_cache
from strategies.capabilities import Ensemble
from strategies.tree import to_host

PyTree = Any


@dataclasses.dataclass(frozen=True)
class Sampling:
  """How tokens are chosen and when a row stops.

  Attributes:
    max_new_tokens: the most tokens generated per prompt.
    temperature: 0 greedy; above 0 the logits are divided by it before sampling.
    top_k: sample among the `top_k` most likely tokens (0: all).
    top_p: sample among the most likely tokens whose probabilities sum to `top_p`
      (nucleus sampling; 1.0: all), in (0, 1].
    stop_tokens: ids that end a row (kept as its last token), e.g. the EOS id.
    pad_id: what fills a row's slots after it stops.
  """

  max_new_tokens: int = 32
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  stop_tokens: tuple[int, ...] = ()
  pad_id: int = 0

  def check(self) -> None:
    """Raises ValueError naming the field, its value and what is accepted."""
    if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
      raise ValueError(f"sampling.max_new_tokens={self.max_new_tokens!r} must be an int >= 1.")
    if not isinstance(self.temperature, int | float) or not self.temperature >= 0:
      raise ValueError(f"sampling.temperature={self.temperature!r} must be >= 0 (0: greedy).")
    if not isinstance(self.top_k, int) or self.top_k < 0:
      raise ValueError(f"sampling.top_k={self.top_k!r} must be an int >= 0 (0: every token).")
    if not isinstance(self.top_p, int | float) or not 0 < self.top_p <= 1:
      raise ValueError(f"sampling.top_p={self.top_p!r} must be in (0, 1] (1: every token).")


@dataclasses.dataclass
class Generation:
  """What `Generator` returns: per prompt, its new tokens (a stop token included)."""

  tokens: list[list[int]]
  #: Whether each row ended at a stop token (else at `max_new_tokens`).
  stopped: list[bool]


def cache_bytes(trainer, abstract_state: PyTree, rows: int, slots: int) -> tuple[int, int]:
  """`(bytes in all, bytes on the fullest device)` of the key/value cache a generation of
  `rows` prompts with `slots` positions (longest prompt + new tokens) keeps, from the
  model's cache abstractly (nothing is computed) and the strategy's rule table."""
  from strategies import layout

  mv, strategy = trainer.model_variables, trainer.strategy
  tokens = jax.ShapeDtypeStruct((rows, 1), jnp.int32)
  rngs = {"params": jax.random.PRNGKey(0), "dropout": jax.random.PRNGKey(0)}
  cache = jax.eval_shape(lambda state, tokens: mv.decode(
      state.params, state.model_state, None, ((tokens,), {"positions": tokens}), rngs=rngs,
      length=slots)[1], abstract_state, tokens)
  total = per_device = 0
  for _, _, size, names, _ in layout.annotations(cache):
    total += size
    per_device += size // math.prod(strategy.shards_of(name) for name in names if name)
  return total, per_device


def logits_of(outputs: Any) -> jax.Array:
  """A model's logits: its output, or the output's `logits` field (`models.moe.MoeOutput`)."""
  return getattr(outputs, "logits", outputs)


def choose(logits: jax.Array, keys: jax.Array, step: jax.Array,
           sampling: Sampling) -> jax.Array:
  """Each row's next token from `logits [rows, vocab]` (`Sampling`'s rules; `keys [rows,
  2]` the rows' raw keys, `step` folded into them: one for all rows, or one per row)."""
  logits = logits.astype(jnp.float32)
  if sampling.temperature == 0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits / sampling.temperature
  if sampling.top_k and sampling.top_k < logits.shape[-1]:
    kth = jax.lax.top_k(logits, sampling.top_k)[0][:, -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  if sampling.top_p < 1:
    ordered = jnp.sort(logits, axis=-1)[:, ::-1]
    probs = jax.nn.softmax(ordered, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # Probability of the tokens ranked above.
    kept = before < sampling.top_p  # The first token always.
    threshold = jnp.min(jnp.where(kept, ordered, jnp.inf), axis=-1, keepdims=True)
    logits = jnp.where(logits < threshold, -jnp.inf, logits)
  steps = jnp.broadcast_to(jnp.asarray(step, jnp.int32), keys.shape[:1])  # Or one per row.
  draw = jax.vmap(lambda key, at, row: jax.random.categorical(jax.random.fold_in(key, at), row))
  return draw(keys, steps, logits).astype(jnp.int32)


def joined(prompts: jax.Array, lengths: jax.Array, new: jax.Array, counts: jax.Array,
           pad_id: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Each row's prompt (`[rows, width]`, right-padded, `lengths` real) then its completion
  (`new[:, :counts]`) then `pad_id`, as one row of `width + new.shape[1]` tokens.

  Returns:
    the tokens; each next-token target's weight (1 where the target is a completion
    token, `[rows, width + steps - 1]`); and each position's index into `new`.
  """
  rows, width = prompts.shape
  steps = new.shape[1]
  position = jnp.arange(width + steps)[None]
  at = jnp.clip(position - lengths[:, None], 0, steps - 1)
  tokens = jnp.where(position < lengths[:, None], jnp.take_along_axis(
      prompts, jnp.clip(position, 0, width - 1), axis=1), jnp.where(
          position - lengths[:, None] < counts[:, None], jnp.take_along_axis(new, at, axis=1),
          pad_id))
  target = position[:, 1:]
  weights = ((target >= lengths[:, None]) & (target < (lengths + counts)[:, None])).astype(
      jnp.float32)
  return tokens, weights, at


def prefill(model_variables, state: PyTree, tokens: jax.Array, lengths: jax.Array, *,
            slots: int):
  """The prompts' prefill into a cache of `slots` positions: `(call, last, cache)`, where
  `call(cache, inputs, positions) -> (logits, cache)` runs more tokens through the cache,
  `last [rows, vocab]` is each row's logits at its last prompt token, and the cache's
  index is each row's length (right-padded `tokens`, `lengths` their own)."""
  rows, width = tokens.shape
  rngs = {"params": jax.random.PRNGKey(0), "dropout": jax.random.PRNGKey(0)}

  def call(cache, inputs, positions):
    outputs, cache = model_variables.decode(state.params, state.model_state, cache,
                                            ((inputs,), {"positions": positions}),
                                            rngs=rngs, length=slots)
    return logits_of(outputs), cache

  positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (rows, width))
  logits, cache = call(None, tokens, positions)
  last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
  return call, last, kv_cache.set_index(cache, lengths)


class Generator:
  """Generates from a state under the strategy it was trained with (module docstring).

  Args:
    model_variables: the Trainer's `model_variables` (Linen or NNX).
    strategy: the Trainer's strategy (the state's layout).
    max_len: the model's positions (`config.model.max_len`): prompt and new tokens fit.
    vocab_size: the real vocabulary (a padded embedding's extra rows are never chosen).
  """

  def __init__(self, model_variables, strategy, *, max_len: int,
               vocab_size: int | None = None):
    self.model_variables = model_variables
    self.strategy = strategy
    self.max_len = max_len
    self.vocab_size = vocab_size
    self._programs: dict[tuple, Any] = {}

  @classmethod
  def from_trainer(cls, trainer) -> Generator:
    model = trainer.config.model
    return cls(trainer.model_variables, trainer.strategy, max_len=model.max_len,
               vocab_size=model.vocab_size)

  def check_layout(self) -> None:
    """Raises ValueError for a layout the cache cannot be kept under, naming it."""
    strategy = self.strategy
    name = getattr(strategy, "name", type(strategy).__name__)
    if isinstance(strategy, Ensemble):
      raise ValueError(
          f"generation under config.strategy.name={name!r}: an ensemble's state holds several "
          f"models; generate from one member's state (strategy.member_state) under "
          f"single_device or sharded_data_parallel.")
    if getattr(strategy, "pipeline", None) is not None:
      raise ValueError(
          f"generation under the 'stage' mesh axis (config.strategy.mesh_axes="
          f"{tuple(strategy.mesh.axis_names)}): the cache of a pipelined layer stack would be "
          f"split over stages; decode under a layout without a 'stage' axis.")
    if getattr(strategy, "context", None) is not None:
      raise ValueError(
          f"generation under the 'context' mesh axis (config.strategy.mesh_axes="
          f"{tuple(strategy.mesh.axis_names)}): the cache holds each sequence whole on a "
          f"device; decode under a layout without a 'context' axis.")
    if strategy.step_sees_batch_shard:
      raise ValueError(
          f"generation under config.strategy.name={name!r}: its programs run per device "
          f"(pmap); generate under single_device or sharded_data_parallel (the same "
          f"checkpoint restores under either).")

  def check(self, prompts: Sequence[Sequence[int]], sampling: Sampling) -> None:
    """Raises ValueError before compute: bad sampling fields, an empty or too long prompt,
    more new tokens than the model's positions leave, or a layout it cannot serve."""
    sampling.check()
    self.check_prompts(prompts, sampling.max_new_tokens)

  def check_prompts(self, prompts: Sequence[Sequence[int]], new_tokens: int = 0) -> None:
    """Raises ValueError before compute: a layout it cannot serve, no prompt, an empty or
    too long one, a token outside the vocabulary, or more `new_tokens` than the model's
    positions leave."""
    self.check_layout()
    if not len(prompts):
      raise ValueError("generation: no prompts (expected one or more lists of token ids).")
    for i, prompt in enumerate(prompts):
      if len(prompt) < 1:
        raise ValueError(f"generation: prompt {i} is empty; every prompt needs a token "
                         f"(e.g. the BOS id).")
      if len(prompt) > self.max_len:
        raise ValueError(
            f"generation: prompt {i} holds {len(prompt)} tokens, more than the model's "
            f"max_len={self.max_len} positions (config.model.max_len).")
    longest = max(len(p) for p in prompts)
    if longest + new_tokens > self.max_len:
      raise ValueError(
          f"sampling.max_new_tokens={new_tokens}: with the longest prompt's "
          f"{longest} tokens the cache would hold {longest + new_tokens} "
          f"positions, more than the model's max_len={self.max_len} "
          f"(config.model.max_len); at most {self.max_len - longest} new tokens fit.")
    if self.vocab_size is not None:
      for i, prompt in enumerate(prompts):
        bad = [(j, t) for j, t in enumerate(prompt) if not 0 <= t < self.vocab_size]
        if bad:
          j, t = bad[0]
          raise ValueError(f"generation: prompt token ids must be in [0, {self.vocab_size}) "
                           f"(config.model.vocab_size); got {t} (prompt {i}, position "
                           f"{j}).")

  def __call__(self, state: PyTree, prompts: Sequence[Sequence[int]],
               sampling: Sampling = Sampling(), *, seed: int = 0) -> Generation:
    """Each prompt's continuation (see the module docstring)."""
    sampling = dataclasses.replace(sampling, stop_tokens=tuple(sampling.stop_tokens))
    self.check(prompts, sampling)
    rows = len(prompts)
    multiple = self.strategy.batch_multiple
    padded_rows = math.ceil(rows / multiple) * multiple
    length = max(len(p) for p in prompts)
    tokens = np.zeros((padded_rows, length), np.int32)
    lengths = np.ones((padded_rows,), np.int32)  # A padding row: one token, dropped after.
    for i, prompt in enumerate(prompts):
      tokens[i, :len(prompt)] = prompt
      lengths[i] = len(prompt)
    keys = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(seed), padded_rows)))
    batch = dict(tokens=tokens, lengths=lengths, keys=keys.astype(np.uint32))
    key = (padded_rows, length, sampling)
    if key not in self._programs:
      self._programs[key] = self.strategy.compile_eval_step(self.program(sampling), state)
    placed = self.strategy.put_batch(self.strategy.local_rows(batch))  # This process's rows.
    new, count, stopped = to_host(self._programs[key](state, placed))
    return Generation([list(map(int, new[i, :count[i]])) for i in range(rows)],
                      [bool(s) for s in stopped[:rows]])

  def logits(self, state: PyTree, prompts: Sequence[Sequence[int]]) -> list[np.ndarray]:
    """Each prompt's logits at each of its positions (`[len(prompt), vocab]`, the real
    vocabulary: the next token's scores after each prefix), from `state` in its layout, in
    float32: the model's own forward pass, no cache."""
    self.check_prompts(prompts)
    rows, length = len(prompts), max(len(p) for p in prompts)
    padded_rows = math.ceil(rows / self.strategy.batch_multiple) * self.strategy.batch_multiple
    tokens = np.zeros((padded_rows, length), np.int32)  # Right-padded: causal, so unread.
    for i, prompt in enumerate(prompts):
      tokens[i, :len(prompt)] = prompt
    key = ("logits", padded_rows, length)
    if key not in self._programs:
      mv, vocab = self.model_variables, self.vocab_size

      def forward(state, batch):
        outputs, _ = mv.apply(state.params, state.model_state, ((batch["tokens"],), {}),
                              rngs={"dropout": jax.random.PRNGKey(0)}, train=False)
        out = logits_of(outputs).astype(jnp.float32)
        return self.strategy.whole_batch(out[..., :vocab] if vocab is not None else out)

      self._programs[key] = self.strategy.compile_eval_step(forward, state)
    placed = self.strategy.put_batch(self.strategy.local_rows({"tokens": tokens}))
    out = np.asarray(self.strategy.outputs_to_host(self._programs[key](state, placed)))
    return [out[i, :len(p)] for i, p in enumerate(prompts)]

  def program(self, sampling: Sampling):
    """`program(state, batch) -> (new tokens [rows, max_new_tokens], counts, stopped)` for
    a batch of right-padded `tokens`, their `lengths` and the rows' raw `keys`; with a
    scalar `active` (a traced bool), False draws the first token only (the loop, whose
    collectives cannot sit in a `lax.cond` branch, runs no step: the caller discards the
    tokens)."""
    mv, vocab = self.model_variables, self.vocab_size
    steps = sampling.max_new_tokens
    stop = jnp.asarray(sampling.stop_tokens or (-1,), jnp.int32)

    def pick(logits, keys, step):
      if vocab is not None:
        logits = logits[:, :vocab]
      return choose(logits, keys, step, sampling)

    def program(state, batch):
      tokens, lengths, keys = batch["tokens"], batch["lengths"], batch["keys"]
      active = batch.get("active", True)
      rows, length = tokens.shape
      call, last, cache = prefill(mv, state, tokens, lengths, slots=length + steps)
      first = pick(last, keys, 0)
      new = jnp.full((rows, steps), sampling.pad_id, jnp.int32).at[:, 0].set(first)
      done = jnp.isin(first, stop)

      def cond(carry):
        t, _, _, _, done = carry
        return (t < steps) & ~jnp.all(done) & active

      def body(carry):
        t, token, cache, new, done = carry
        logits, cache = call(cache, token[:, None], (lengths + t - 1)[:, None])
        chosen = jnp.where(done, sampling.pad_id, pick(logits[:, 0], keys, t))
        new = new.at[:, t].set(chosen)
        return t + 1, chosen, cache, new, done | jnp.isin(chosen, stop)

      _, _, _, new, done = jax.lax.while_loop(cond, body, (jnp.int32(1), first, cache, new, done))
      is_stop = jnp.isin(new, stop)
      first_stop = jnp.argmax(is_stop, axis=1)
      count = jnp.where(done, first_stop + 1, steps)
      return new, count, done

    return program
