"""Multi-turn rollouts with tools, each turn continued from the key/value cache, inside
the train step::

    turns = MultiTurn(episodes, generator, sampling, host_calls)
    prompts, ok = turns.prompts(records, group=g, step=step, rows=rows)  # On the host.
    out = turns.program()(state, {**prompts, "keys": keys})

The loop is the `Generator`'s, under the training layout, with one more source of
tokens. At each step every live row samples a token at its own completion position and
feeds it through the model's cache. When rows sample their end-of-turn token (EOS), one
host call (`jax.pure_callback` through `trainer.step.host_calls`, under `lax.cond`, so a
step where no turn ends makes no call) hands their turns to
`trainer.rl.episodes.Episodes`, which calls their tools and answers each row's tool-turn
tokens or the end of its rollout. A tool turn runs through the model in that same step,
in one call with the token that ended the turn (the narrowest of `MultiTurn.widths` that
holds it), and the row's position moves past it. Only new tokens run through the model:
the prompt and every earlier turn stay in the cache. The loop ends when every rollout has
ended or reached `max_completion_length`.

The outputs: each row's completion (its own turns, the tool turns, then padding), its
length, whether it ended by itself, the tool mask (1 on tool-turn tokens, which the
loss weighs 0) and the host calls' `ok`.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from trainer.rl import data as rl_data
from trainer.rl.episodes import Episodes

PyTree = Any
#: The extra keys of a multi-turn rollout batch.
HANDLE = "handle"


def seeds_of(step: int, rows: np.ndarray) -> list[int]:
  """Each row's environment seed: a function of the step and the row (its index in the
  global batch), so a rerun of the step resets the environments as the first run did."""
  return [int(np.uint32((int(step) * 1_000_003 + int(r) * 7_919 + 17) % 2**32))
          for r in np.asarray(rows)]


class MultiTurn:
  """The multi-turn rollout's two host calls and its compiled loop (module docstring).

  Args:
    episodes: the host state (`trainer.rl.episodes.Episodes`).
    generator: the run's `trainer.generation.Generator` (its model and layout).
    sampling: how tokens are chosen; its `stop_tokens` end a turn.
    host_calls: the compiled steps' `HostCalls`.
    policy: `policy(logits, keys, t, new, tool) -> tokens [rows]` in place of sampling
      from the logits (a test's scripted assistant); None: `Sampling`'s draw.
  """

  def __init__(self, episodes: Episodes, generator, sampling, host_calls, policy=None):
    self.episodes, self.generator = episodes, generator
    self.sampling, self.host_calls = sampling, host_calls
    self.policy = policy

  # -- Host calls ------------------------------------------------------------------------

  def _host_prompts(self, records, step, rows, *, group: int, width: int):
    real = np.repeat(np.asarray(records).any(axis=-1), group)  # Eval padding: no record.
    each = iter(rl_data.records_of(np.asarray(records)[np.asarray(records).any(axis=-1)]))
    kept = [next(each) for _ in range(int(real.sum()) // group)]
    records = [r for r in kept for _ in range(group)]
    records = [records.pop(0) if is_real else None for is_real in real]
    handle, prompts = self.episodes.start(records, seeds_of(int(step), rows))
    tokens = np.full((len(prompts), width), self.sampling.pad_id, np.int32)
    for i, p in enumerate(prompts):
      tokens[i, :len(p)] = p
    return tokens, np.asarray([len(p) for p in prompts], np.int32), np.int32(handle)

  def prompts(self, records: jax.Array, *, group: int, step: jax.Array, rows: jax.Array
              ) -> tuple[dict[str, jax.Array], jax.Array]:
    """The rollouts' prompts (`group` per record), rendered on the host with the tools and
    each environment's reset text, and the rollouts' handle; and `ok`."""
    n, width = records.shape[0] * group, self.episodes.max_prompt_length
    shapes = (jax.ShapeDtypeStruct((n, width), jnp.int32),
              jax.ShapeDtypeStruct((n,), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32))
    (tokens, lengths, handle), ok = self.host_calls.call(
        functools.partial(self._host_prompts, group=group, width=width), shapes, records,
        step, rows)
    return {"tokens": tokens, "lengths": jnp.maximum(lengths, 1), HANDLE: handle}, ok

  def _host_turn(self, handle, ended, new, ends):
    rows = np.flatnonzero(np.asarray(ended))
    steps = new.shape[1]
    block = np.full((new.shape[0], steps), self.sampling.pad_id, np.int32)
    length = np.zeros((new.shape[0],), np.int32)
    finish = np.zeros((new.shape[0],), np.bool_)
    if len(rows):
      for row, ids in self.episodes.turn(int(handle), rows, np.asarray(new),
                                         np.asarray(ends)).items():
        if ids is None:
          finish[row] = True
        else:
          block[row, :len(ids)], length[row] = ids, len(ids)
    return block, length, finish

  # -- The loop ----------------------------------------------------------------------------

  @staticmethod
  def widths(steps: int) -> tuple[int, ...]:
    """The tool-turn widths the loop feeds in one model call (powers of two from 8, and
    the budget): a tool turn runs through the model in one call of the smallest that
    holds it, with the token that ended the turn before it; 0: that token alone."""
    out = [0]
    while (out[-1] or 4) * 2 < steps:
      out.append((out[-1] or 4) * 2)
    return (*out, steps)

  def program(self):
    """`program(state, batch) -> (new, counts, stopped, tool, ok)` for a batch of
    right-padded prompt `tokens`, their `lengths`, the rows' raw `keys` and the episodes'
    `handle` (`prompts`)."""
    from models import kv_cache
    from trainer.generation import choose, prefill
    mv, vocab, sampling = self.generator.model_variables, self.generator.vocab_size, (
        self.sampling)
    steps = sampling.max_new_tokens
    stop = jnp.asarray(sampling.stop_tokens or (-1,), jnp.int32)
    pad = sampling.pad_id
    widths = self.widths(steps)

    def pick(logits, keys, at):
      return choose(logits[:, :vocab] if vocab is not None else logits, keys, at, sampling)

    def program(state, batch):
      tokens, lengths, keys, handle = (batch["tokens"], batch["lengths"], batch["keys"],
                                       batch[HANDLE])
      rows, width = tokens.shape
      # A call of 1 + w tokens writes them all at a row's cache index; what lies past the
      # row's own tokens is never attended (a query sees the slots at or before it) and is
      # overwritten, but must fit: the slots leave room for the widest call.
      call, last, cache = prefill(mv, state, tokens, lengths,
                                  slots=width + steps + widths[-1] + 1)
      every = jnp.arange(rows)
      shapes = (jax.ShapeDtypeStruct((rows, steps), jnp.int32),
                jax.ShapeDtypeStruct((rows,), jnp.int32),
                jax.ShapeDtypeStruct((rows,), jnp.bool_))

      def host(new, tool, ended, at):  # Where a turn ends: its tool turn, appended.
        (block, length, finish), ok = self.host_calls.call(self._host_turn, shapes, handle,
                                                           ended, new, at)
        length = jnp.where(ended & ~finish, length, 0)
        span = at[:, None] + 1 + jnp.arange(steps)[None]  # The tool turn's positions.
        inside = jnp.arange(steps)[None] < length[:, None]
        new = new.at[every[:, None], span].set(jnp.where(inside, block, pad), mode="drop")
        tool = tool.at[every[:, None], span].set(inside, mode="drop")
        return new, tool, block, length, finish, ok

      def no_turn(new, tool, ended, at):
        del ended, at
        return (new, tool, jnp.full((rows, steps), pad, jnp.int32),
                jnp.zeros((rows,), jnp.int32), jnp.zeros((rows,), jnp.bool_), jnp.bool_(True))

      def feed(w):  # The chosen token, then up to w of a tool turn's, in one call.
        def run(cache, chosen, block, length, at):
          inputs = jnp.concatenate([chosen[:, None], block[:, :w]], axis=1)
          where = (lengths + at)[:, None] + jnp.arange(1 + w, dtype=jnp.int32)[None]
          out, cache = call(cache, inputs, where)
          cache = kv_cache.set_index(cache, lengths + at + 1 + length)
          return out[every, jnp.minimum(length, w)], cache
        return run

      def cond(c):
        return jnp.any(~c["done"] & (c["at"] < steps))

      def body(c):
        at = c["at"]  # Each row's next completion position.
        live = ~c["done"] & (at < steps)
        sampled = (pick(c["logits"], keys, at) if self.policy is None
                   else self.policy(c["logits"], keys, at, c["new"], c["tool"]))
        chosen = jnp.where(live, sampled, pad)
        new = c["new"].at[every, at].set(chosen, mode="drop")
        ended = live & jnp.isin(chosen, stop)
        new, tool, block, length, finish, ok = jax.lax.cond(
            jnp.any(ended), host, no_turn, new, c["tool"], ended, at)
        branch = jnp.sum(jnp.asarray(widths[:-1]) < jnp.max(length)).astype(jnp.int32)
        logits, cache = jax.lax.switch(branch, [feed(w) for w in widths], c["cache"], chosen,
                                       block, length, at)
        return dict(logits=logits, cache=cache, new=new, tool=tool,
                    done=c["done"] | (ended & finish),
                    count=jnp.where(ended & finish, at + 1, c["count"]), ok=c["ok"] & ok,
                    at=jnp.where(live, at + 1 + length, at))

      carry = dict(logits=last, cache=cache, new=jnp.full((rows, steps), pad, jnp.int32),
                   tool=jnp.zeros((rows, steps), jnp.bool_), done=jnp.zeros((rows,), jnp.bool_),
                   count=jnp.full((rows,), steps, jnp.int32), ok=jnp.bool_(True),
                   at=jnp.zeros((rows,), jnp.int32))
      out = jax.lax.while_loop(cond, body, carry)
      return out["new"], out["count"], out["done"], out["tool"], out["ok"]

    return program


#: Each rollout's tool statistics, in `stats` columns: calls, failed calls, assistant turns.
STATS = ("calls", "failures", "turns")


def closed(episodes: Episodes, handle: int, new: np.ndarray, counts: np.ndarray
           ) -> tuple[list, np.ndarray]:
  """The rollouts of `handle`, ended (`Episodes.close`), and their `STATS` `[rows, 3]`."""
  done = episodes.close(handle, np.asarray(new), np.asarray(counts))
  stats = np.asarray([[e.calls, e.failures, max(1, sum(m["role"] == "assistant"
                                                       for m in e.messages))]
                      for e in done], np.float32).reshape(len(done), len(STATS))
  return done, stats


def environment_reward(toolbox) -> Any:
  """The environment's `get_reward` as one more reward function (TRL's: named after the
  class, weight 1; None for a rollout whose environment is another class)."""
  from trainer.rl.rewards import Reward
  cls = toolbox.environment

  def get_reward(environments, **kwargs):
    del kwargs
    return [e.get_reward() if type(e) is cls else None for e in environments]

  return Reward(f"{cls.__module__}:{cls.__name__}.get_reward", get_reward, 1.0, cls.__name__)


def build(trainer) -> MultiTurn:
  """The run's multi-turn rollouts, its chat template checked before anything compiles.

  Raises:
    ToolError: a chat template that does not render the tools, or whose tool calls this
      project cannot read, naming the file.
  """
  from trainer.rl.tools import ToolError
  rl, config = trainer.rl, trainer.config
  tokenizer = trainer.tokenizer
  try:
    template = tokenizer.chat_template()
  except ValueError as e:
    raise ToolError(f"config.rl.tools / environment: {e}") from None
  episodes = Episodes(trainer.toolbox, tokenizer,
                      max_iterations=rl.max_tool_calling_iterations,
                      budget=rl.max_completion_length, max_prompt_length=rl.max_prompt_length,
                      prompt_field=config.rl.prompt_field)
  probe = template.render([{"role": "user", "content": "?"}], add_generation_prompt=True,
                          tools=episodes.schemas)
  missing = [s["function"]["name"] for s in episodes.schemas
             if s["function"]["name"] not in probe]
  if missing or episodes.format is None:
    raise ToolError(
        f"config.rl.tools / environment: the chat template of {template.where} "
        + (f"does not render the tools {missing} into the prompt"
           if missing else "renders tool calls in a format this project does not read")
        + "; tools need a template that renders them (apply_chat_template(tools=...)) and "
        "calls in one of the formats of trainer.rl.tool_calls (Qwen's <tool_call> JSON, "
        "Llama 3's JSON).")
  return MultiTurn(episodes, trainer.generator, trainer.sampling,
                   trainer.compiled.host_calls)


def scripted(script: list[list[list[int]]]):
  """A scripted assistant for `MultiTurn(policy=...)` (tests and benchmarks): row r's
  k-th turn is `script[r][k]` (token ids, its last the end-of-turn token), whatever the
  logits; a row past its script repeats its last turn; rows beyond the script's reuse it
  (row r takes `script[r % len(script)]`)."""
  rows, turns = len(script), max(len(s) for s in script)
  width = max(len(t) for s in script for t in s)
  table = np.zeros((rows, turns, width), np.int32)
  for r, row in enumerate(script):
    for k, ids in enumerate(row):
      table[r, k, :len(ids)], table[r, k, len(ids):] = ids, ids[-1]
  table = jnp.asarray(table)

  def policy(logits, keys, t, new, tool):
    del logits, keys, new
    steps = tool.shape[1]
    ends = tool[:, :-1] & ~tool[:, 1:]  # Tool turns finished before position t.
    turn = jnp.sum(ends, axis=1) + tool[:, -1]
    last = jnp.max(jnp.where(tool, jnp.arange(1, steps + 1)[None], 0), axis=1)
    offset = jnp.clip(t - last, 0, width - 1)
    return table[jnp.arange(tool.shape[0]) % rows, jnp.minimum(turn, turns - 1), offset]

  return policy
