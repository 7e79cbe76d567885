"""The host's side of multi-turn rollouts: each rollout's environment, its conversation,
and the tool turns appended to it (`trainer.rl.multi_turn` runs the tokens).

One `Episode` per rollout (a prompt's completion). `Episodes.start` builds the rollouts
of a batch: an environment instance each, `reset(**record)` with a seed from the step
and the row, and the prompt rendered by the chat template with the tools' schemas (the
reset's text appended to the last user message). `Episodes.turn` is called when rows
end an assistant turn (their end-of-turn token): it reads each turn's tool calls
(`trainer.rl.tool_calls`), calls them, and answers the tokens of the tool turn to
append (TRL 1.16's rule: the template's rendering of the tool messages after an
assistant call, from the end-of-turn token through the next assistant header; ids are
appended, never re-tokenized), or that the rollout ends: no call, the
`max_tool_calling_iterations` reached, or a tool turn that would pass
`max_completion_length` (the tools have run and are counted; the rollout ends on its
call). `Episodes.close` reads the last turn and hands the conversations, the
environments and the counts to the rewards.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from trainer.rl import tool_calls
from trainer.rl import tools as tools_lib
from trainer.rl.tools import Toolbox


@dataclasses.dataclass
class Episode:
  """One rollout: its environment, tools and the completion's messages so far."""

  environment: Any
  functions: dict
  messages: list = dataclasses.field(default_factory=list)
  turn_start: int = 0  # Where the current assistant turn starts in the completion.
  iterations: int = 0  # Tool turns appended.
  calls: int = 0
  failures: int = 0
  finished: bool = False


class Episodes:
  """Multi-turn rollouts' host state (module docstring).

  Args:
    toolbox: the tools and the environment class (`trainer.rl.tools`).
    tokenizer: the run's tokenizer (`trainer.data.corpus.Tokenizer`) with a chat template.
    max_iterations: `config.rl.max_tool_calling_iterations`.
    budget: `config.rl.max_completion_length`.
    max_prompt_length: `config.rl.max_prompt_length`.
    prompt_field: `config.rl.prompt_field`.
  """

  def __init__(self, toolbox: Toolbox, tokenizer, *, max_iterations: int,
               budget: int, max_prompt_length: int, prompt_field: str = "prompt"):
    self.toolbox, self.tokenizer = toolbox, tokenizer
    self.template = tokenizer.chat_template()
    self.format = tool_calls.format_of(self.template.template)
    self.max_iterations, self.budget = max_iterations, budget
    self.max_prompt_length, self.prompt_field = max_prompt_length, prompt_field
    self.schemas = toolbox.schemas
    self._by_name = {s["function"]["name"]: s for s in self.schemas}
    self._eos = tokenizer.eos_id
    self._eos_text = tokenizer.tokenizer.id_to_token(self._eos) if self._eos is not None else ""
    self._open: dict[int, list[Episode]] = {}
    self._next = 0
    self._suffixes: dict[tuple, list[int]] = {}

  # -- Text ------------------------------------------------------------------------------

  def encode(self, text: str) -> list[int]:
    return self.tokenizer.tokenizer.encode(text, add_special_tokens=False).ids

  def conversation(self, prompt: Any) -> list[dict]:
    """A record's prompt as a conversation (a text prompt is one user turn)."""
    if isinstance(prompt, str):
      return [{"role": "user", "content": prompt}]
    return [dict(m) for m in prompt]

  def prompt_ids(self, messages: Sequence[Mapping]) -> list[int]:
    """The prompt as TRL renders it: the template with the tools' schemas and the
    generation prompt."""
    return self.encode(self.template.render(messages, add_generation_prompt=True,
                                            tools=self.schemas or None))

  def tool_turn(self, tool_messages: Sequence[Mapping]) -> list[int]:
    """The ids of the tool turn that follows an assistant's call (TRL's
    `_get_tool_suffix_ids`): a dummy call rendered with and without the tool messages and
    the next generation prompt; what the second adds after the call's end-of-turn token."""
    key = tuple((m["name"], m["content"]) for m in tool_messages)
    if key not in self._suffixes:
      call = [{"type": "function", "function": {"name": tool_messages[0]["name"],
                                                "arguments": {}}}]
      dummy = [{"role": "user", "content": "dummy"},
               {"role": "assistant", "content": "", "tool_calls": call}]
      prefix = self.encode(self.template.render(dummy))
      full = self.encode(self.template.render(dummy + list(tool_messages),
                                              add_generation_prompt=True))
      ends = [i for i, t in enumerate(prefix) if t == self._eos]
      if ends:
        prefix = prefix[:ends[-1] + 1]
      if full[:len(prefix)] != prefix:
        raise tools_lib.ToolError(
            f"the chat template of {self.template.where} renders a tool turn that does not "
            f"extend the assistant's call; its tokens cannot be appended to the rollout.")
      self._suffixes[key] = full[len(prefix):]
    return self._suffixes[key]

  def read(self, ids: Sequence[int]) -> dict:
    """An assistant turn's ids as a message (with its tool calls)."""
    decode = self.tokenizer.tokenizer.decode
    return tool_calls.parse(decode(list(ids), skip_special_tokens=False), self.format,
                            end_of_turn=self._eos_text,
                            plain=decode(list(ids), skip_special_tokens=True))

  # -- A batch's rollouts ------------------------------------------------------------------

  def start(self, records: Sequence[Mapping | None], seeds: Sequence[int]
            ) -> tuple[int, list[list[int]]]:
    """A handle for the rollouts of `records` (one per rollout; None for a padding row)
    and their prompts' ids.

    Raises:
      ValueError: a prompt, with its environment's text, longer than max_prompt_length.
    """
    episodes, prompts = [], []
    for record, seed in zip(records, seeds, strict=True):
      if record is None:  # A padding row of an eval batch: a rollout nobody reads.
        episodes.append(Episode(None, {}, finished=True))
        prompts.append(self.prompt_ids([{"role": "user", "content": ""}]))
        continue
      environment = self.toolbox.new_environment()
      messages = self.conversation(record[self.prompt_field])
      if environment is not None:
        extra = self.toolbox.reset(environment, record, int(seed))
        if extra is not None:
          messages[-1] = {**messages[-1], "content": messages[-1]["content"] + extra}
      ids = self.prompt_ids(messages)
      if len(ids) > self.max_prompt_length:
        raise ValueError(f"a prompt rendered with its tools (and its environment's reset "
                         f"text) holds {len(ids)} tokens, more than config.rl."
                         f"max_prompt_length={self.max_prompt_length}; raise it.")
      episodes.append(Episode(environment, self.toolbox.functions(environment)))
      prompts.append(ids)
    handle = self._next
    self._next += 1
    self._open[handle] = episodes
    return handle, prompts

  def _run_calls(self, episode: Episode, message: dict) -> list[dict]:
    results = []
    for call in message["tool_calls"]:
      function = call["function"]
      episode.calls += 1
      text, ok = tools_lib.call(episode.functions, self._by_name, function["name"],
                                function["arguments"])
      episode.failures += not ok
      results.append({"role": "tool", "name": function["name"], "content": text})
    return results

  def turn(self, handle: int, rows: Sequence[int], completions: np.ndarray, ends
           ) -> dict[int, list[int] | None]:
    """For each of `rows`, whose assistant turn ended at completion position `ends[row]`
    (or `ends`, one for all): the tool turn's ids to append, or None where the rollout
    ends."""
    out = {}
    ends = np.broadcast_to(np.asarray(ends), (len(completions),))
    for row in rows:
      end = int(ends[row])
      episode = self._open[handle][row]
      if episode.finished:  # A padding row.
        out[row] = None
        continue
      message = self.read(completions[row, episode.turn_start:end + 1])
      episode.messages.append(message)
      if not message.get("tool_calls") or episode.iterations >= self.max_iterations:
        episode.finished, out[row] = True, None
        continue
      results = self._run_calls(episode, message)
      block = self.tool_turn(results)
      if end + 1 + len(block) > self.budget:  # Rolled back: the rollout ends on its call.
        episode.finished, out[row] = True, None
        continue
      episode.messages.extend(results)
      episode.iterations += 1
      episode.turn_start = end + 1 + len(block)
      out[row] = block
    return out

  def close(self, handle: int, completions: np.ndarray, counts: Sequence[int]
            ) -> list[Episode]:
    """The rollouts of `handle`, each with its last turn read (a turn cut at the budget
    whose calls are whole has them run and counted, as TRL does, with nothing appended)."""
    episodes = self._open.pop(handle)
    for row, episode in enumerate(episodes):
      if episode.finished:
        continue
      ids = completions[row, episode.turn_start:int(counts[row])]
      if not len(ids):
        continue
      message = self.read(ids)
      episode.messages.append(message)
      if message.get("tool_calls") and episode.iterations < self.max_iterations:
        self._run_calls(episode, message)
    return episodes

  def discard(self, handle: int) -> None:
    self._open.pop(handle, None)
