"""Sample completions of an RL run, as TRL's completions table shows them.

The reward call of each train step (on the host) keeps its first `config.rl.log_completions`
rows in a `Samples`; every `config.log_every_steps` the `CompletionSamples` action writes the
latest as a Markdown table, `completions`, to the run's writers (TensorBoard's Text tab,
`texts.jsonl`, the console): each row's prompt, its completion, its total reward and each
function's. A multi-turn completion shows every turn: the assistant's text, its calls as
`[call name({...})]` and each tool's result as `[name -> result]`.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from trainer.loop.actions import Action
from trainer.writers import markdown_table


def _turn(message: Mapping) -> str:
  """One turn of a multi-turn completion: an assistant's text and calls, a tool's result."""
  if message.get("role") == "tool":
    return f"[{message.get('name', 'tool')} -> {message.get('content', '')}]"
  calls = " ".join(f"[call {c['function']['name']}({json.dumps(c['function']['arguments'])})]"
                   for c in message.get("tool_calls") or ())
  return " ".join(part for part in (message.get("content", ""), calls) if part)


def _text(value: Any) -> Any:
  """A conversation as its last turn's text (a prompt's user turn, a completion); a
  multi-turn completion (tool calls and their results) as all its turns."""
  if isinstance(value, list) and value and isinstance(value[-1], Mapping):
    if len(value) > 1 or value[-1].get("tool_calls"):
      return " ".join(_turn(m) for m in value)
    return value[-1].get("content", json.dumps(value))
  return value


class Samples:
  """The latest train rollout's first `rows` completions, kept by the reward call."""

  def __init__(self, rows: int):
    self.rows = rows
    self._lock = threading.Lock()
    self._latest: tuple[int, list[list[Any]], list[str]] | None = None

  def keep(self, step: int, prompts: Sequence[Any], completions: Sequence[Any],
           totals: Sequence[float], each: Mapping[str, Sequence[float]]) -> None:
    """Keeps a reward call's first rows: prompts, completions, totals and each function's
    values (NaN: not applicable)."""
    if not self.rows:
      return
    names = list(each)
    rows = [[_text(prompts[i]), _text(completions[i]), totals[i],
             *(each[n][i] for n in names)] for i in range(min(self.rows, len(completions)))]
    with self._lock:
      self._latest = (int(step), rows, names)

  def table(self) -> str | None:
    """The latest rows as a Markdown table (None: none kept yet)."""
    with self._lock:
      latest = self._latest
    if latest is None:
      return None
    step, rows, names = latest
    return f"step {step}\n\n" + markdown_table(["prompt", "completion", "reward", *names],
                                               rows)


class CompletionSamples(Action):
  """Writes the latest `Samples` table to `writer` as the text `completions`."""

  def __init__(self, writer, samples: Samples, *, every_steps: int):
    super().__init__(every_steps=every_steps)
    self.writer, self.samples = writer, samples

  def next_boundary(self, step: int) -> None:
    return None  # It reads the host's samples, not the state: any call's end will do.

  def run(self, view) -> None:
    table = self.samples.table()
    if table is not None:
      self.writer.write_texts(view.step, {"completions": table})
