"""An assistant turn's tool calls, read in the model family's format, as TRL 1.16's
`parse_response` reads them for the templates it knows.

- `qwen` (Qwen 2.5 and 3, Hermes-style): each call is `<tool_call>` JSON
  `{"name": ..., "arguments": {...}}` `</tool_call>`; several calls share a turn.
- `llama3` (Llama 3.1 and 3.2): the turn is one JSON object
  `{"name": ..., "parameters": {...}}` before `<|eot_id|>`.

The format is told from the chat template's text (`format_of`). A turn whose call is
not valid JSON, or names no tool, is plain text: no call and no failure (TRL's
fallback). A turn is read from its text with special tokens kept; its `content` is the
text outside the calls, the end-of-turn token and a Qwen `<think>` block left out.
"""

from __future__ import annotations

import json
import re
from typing import Any

FORMATS = ("qwen", "llama3")

_QWEN_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_THINK = re.compile(r"^\s*<think>(.*?)</think>\s*", re.DOTALL)
_LLAMA_CALL = re.compile(r'\{"name":\s*"(?P<name>[^"]+)",\s*"parameters":\s*')


def format_of(template: str) -> str | None:
  """The tool-call format a chat template's text shows (None: none this module reads)."""
  if "<tool_call>" in template:
    return "qwen"
  if "<|eot_id|>" in template and "parameters" in template:
    return "llama3"
  return None


def _call(name: Any, arguments: Any) -> dict:
  if not isinstance(name, str):
    raise ValueError("a tool call names no tool")
  if arguments is None:
    arguments = {}
  if not isinstance(arguments, dict):
    raise ValueError("a tool call's arguments are not an object")
  return {"type": "function", "function": {"name": name, "arguments": arguments}}


def parse(text: str, fmt: str, *, end_of_turn: str, plain: str) -> dict:
  """An assistant turn as a message: `{"role": "assistant", "content": ...}`, with
  `tool_calls` where it calls any. `text` is the turn with special tokens, `plain` the same
  turn decoded without them (the content of a turn that is not read as calls)."""
  if fmt not in FORMATS:
    raise ValueError(f"unknown tool-call format {fmt!r}; known: {FORMATS}")
  body = text.split(end_of_turn, 1)[0] if end_of_turn else text
  try:
    message = {"role": "assistant"}
    if fmt == "qwen":
      think = _THINK.match(body)
      if think:
        message["reasoning_content"] = think.group(1).strip()
        body = body[think.end():]
      calls = [json.loads(m.group(1).strip()) for m in _QWEN_CALL.finditer(body)]
      calls = [_call(c.get("name") if isinstance(c, dict) else None,
                     c.get("arguments") if isinstance(c, dict) else None) for c in calls]
      first = body.find("<tool_call>")
      content = body if first < 0 else body[:first]
    else:
      match = _LLAMA_CALL.search(body)
      calls, content = [], body
      if match:
        rest = body[match.end():].rstrip()
        if not rest.endswith("}"):
          raise ValueError("an unclosed call")
        calls = [_call(match.group("name"), json.loads(rest[:-1]))]
        content = body[:match.start()]
    message["content"] = content.strip()
    if calls:
      message["tool_calls"] = calls
    return message
  except (ValueError, TypeError):  # Malformed: the turn is plain text.
    return {"role": "assistant", "content": plain}
