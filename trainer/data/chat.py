"""Instruction data rendered with a model's chat template, and which characters are the
assistant's (what the loss trains on).

A Hugging Face model directory holds its chat template, a Jinja2 template, in
`chat_template.jinja` (`transformers` 5) or as `tokenizer_config.json`'s `chat_template`.
It is rendered as `transformers`' `apply_chat_template` renders it: a sandboxed
environment with `trim_blocks` and `lstrip_blocks`, `raise_exception` and `strftime_now`,
a `tojson` that keeps non-ASCII text, and the tokenizer's special tokens as variables
(`bos_token`, `eos_token`, ...).

A record is either `{"messages": [{"role": ..., "content": ...}, ...]}` or a prompt and
a response (`{"prompt": ..., "response": ...}`, a user turn and an assistant turn). Each
assistant turn's span is what the conversation up to it adds to the conversation before
it with the generation prompt: the turn's text and its end-of-turn tokens.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence


class ChatError(ValueError):
  """A chat template that cannot render a record, or renders it inconsistently."""


class ChatTemplate:
  """A chat template and the special tokens it sees.

  Args:
    template: the Jinja2 source (`tokenizer_config.json`'s `chat_template`).
    special_tokens: variables such as `bos_token`, `eos_token` (strings).
    where: the file it came from, for errors.
  """

  def __init__(self, template: str, special_tokens: Mapping[str, str], where: str = ""):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
      raise ChatError(f"the chat template of {where} refused the record: {message}")

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
      return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                        sort_keys=sort_keys)

    def strftime_now(fmt):
      return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    self.template, self.where = template, where
    self._compiled = env.from_string(template)
    self.special_tokens = dict(special_tokens)

  @classmethod
  def from_directory(cls, directory: str, settings: Mapping) -> ChatTemplate:
    """A model directory's template, where `transformers` reads it: `chat_template.jinja`
    (what `save_pretrained` writes since `transformers` 5), else `tokenizer_config.json`'s
    `chat_template` (`settings`, that file's contents); its special tokens from `settings`.

    Raises:
      ChatError: the directory holds neither.
    """
    import os
    jinja = os.path.join(directory, "chat_template.jinja")
    if os.path.isfile(jinja):
      with open(jinja, encoding="utf-8") as f:
        settings = {**settings, "chat_template": f.read()}
      return cls.from_tokenizer_config(settings, jinja)
    return cls.from_tokenizer_config(settings, os.path.join(directory, "tokenizer_config.json"))

  @classmethod
  def from_tokenizer_config(cls, settings: Mapping, where: str) -> ChatTemplate:
    """The template and special tokens of a `tokenizer_config.json`'s contents.

    Raises:
      ChatError: it has no `chat_template`.
    """
    template = settings.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
      named = {t.get("name"): t.get("template") for t in template}
      template = named.get("default")
    if not isinstance(template, str):
      raise ChatError(f"{where} has no chat_template, and no chat_template.jinja is beside "
                      f"it; chat records (lists of turns, or config.data.chat=True) are "
                      f"rendered with the model's chat template.")
    tokens = {}
    for key, value in settings.items():
      if key.endswith("_token") and isinstance(value, (str, dict)):
        tokens[key] = value.get("content") if isinstance(value, dict) else value
    return cls(template, tokens, where)

  def render(self, messages: Sequence[Mapping[str, str]], *,
             add_generation_prompt: bool = False, tools: Sequence[Mapping] | None = None
             ) -> str:
    """The conversation as text; `tools`: the schemas of the tools the model may call
    (`trainer.rl.tools`), as `apply_chat_template(..., tools=...)` passes them."""
    return self._compiled.render(messages=list(messages), tools=list(tools) if tools else None,
                                 add_generation_prompt=add_generation_prompt,
                                 **self.special_tokens)

  def render_with_spans(self, messages: Sequence[Mapping[str, str]]
                        ) -> tuple[str, list[tuple[int, int]]]:
    """The whole conversation, and the `[start, end)` character spans of its assistant turns.

    Raises:
      ChatError: the template renders a conversation that does not begin with its render
        up to an assistant turn (the spans would be wrong).
    """
    text = self.render(messages)
    spans = []
    for i, message in enumerate(messages):
      if message.get("role") != "assistant":
        continue
      before = self.render(messages[:i], add_generation_prompt=True)
      upto = self.render(messages[:i + 1])
      if not (upto.startswith(before) and text.startswith(upto)):
        raise ChatError(f"the chat template of {self.where} renders turn {i} of a "
                        f"conversation so that it does not extend the turns before it; the "
                        f"assistant's tokens cannot be told apart.")
      spans.append((len(before), len(upto)))
    return text, spans


def messages_of(record: Mapping, *, messages_field: str = "messages",
                prompt_field: str = "prompt", response_field: str = "response"
                ) -> list[dict[str, str]] | None:
  """A record's conversation: its `messages`, or its prompt and response as a user and an
  assistant turn; None if it holds neither (or they are not text)."""
  messages = record.get(messages_field)
  if isinstance(messages, list) and messages and all(
      isinstance(m, Mapping) and isinstance(m.get("role"), str)
      and isinstance(m.get("content"), str) for m in messages):
    if any(m["role"] == "assistant" for m in messages):
      return [{"role": m["role"], "content": m["content"]} for m in messages]
    return None
  prompt, response = record.get(prompt_field), record.get(response_field)
  if isinstance(prompt, str) and isinstance(response, str) and response.strip():
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
  return None
