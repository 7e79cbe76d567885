"""The tool-use task of `configs/rl.py:tools` (offline): a table only a tool can read.

Each rollout's environment (`Table`) draws a digit for every key of `KEYS` from its seed;
the prompt asks for one key's value (`"What is ash?"`). The model cannot know it without
calling `lookup(key)`, whose result the environment answers in a tool turn; the reward
(`correct_value`) is 1 where the rollout's last answer is the drawn digit. Files, written
by `write_task`: a character-level tokenizer whose chat template renders the tools and
reads Qwen-style `<tool_call>` JSON, the prompts, and demonstrations (whole
conversations with a call and its answer) for a short supervised warm start.
"""

from __future__ import annotations

import json
import os
import random

KEYS = ("ash", "bay", "elm", "fir", "oak", "yew", "box", "gum", "fig", "tea", "rye", "ivy")
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>")
CHARACTERS = "abcdefghijklmnopqrstuvwxyzTW?0123456789 \n{}\":,()"
#: Whole tokens for the template's and the call's fixed words and JSON: short rows (a
#: conversation is 45 tokens), and a result's digit a few tokens from where the answer
#: repeats it.
WORDS = ("assistant", "system", "user", "tool", "lookup", "key", "Tools: ", "What is ",
         '{"name": "', '", "arguments": {"key": "', '"}}')
#: A compact ChatML template that renders the tools' names and parameters, an assistant's
#: calls as `<tool_call>` JSON and a tool's result as a `tool` turn.
TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {% for t in tools %}{{ t.function.name }}("
    "{{ t.function.parameters.properties | list | join(', ') }}){% endfor %}<|im_end|>\n"
    "{% endif %}{% for m in messages %}{% if m.role == 'assistant' and m.tool_calls %}"
    "<|im_start|>assistant\n{{ m.content }}{% for c in m.tool_calls %}<tool_call>"
    "{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}"
    "</tool_call>{% endfor %}<|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}")


class Table:
  """A table of a digit per key, drawn from the rollout's seed; `lookup` reads it."""

  def reset(self, key: str = "", seed: int = 0, **kwargs) -> None:
    rng = random.Random(seed)
    self.values = {k: str(rng.randrange(10)) for k in KEYS}
    self.key = key

  def lookup(self, key: str) -> str:
    """The table's value for a key.

    Args:
      key: the name of the row to read.
    """
    return self.values[key]


def correct_value(completions, environments, **kwargs):
  """1.0 where the rollout's last assistant turn is its table's value for the asked key."""
  out = []
  for turns, table in zip(completions, environments, strict=True):
    last = [m for m in turns if m["role"] == "assistant"][-1]["content"]
    out.append(1.0 if last.strip() == table.values[table.key] else 0.0)
  return out


def write_task(directory: str, *, demonstrations: int = 2000, seed: int = 0
               ) -> tuple[str, str, str]:
  """The tokenizer (with `chat_template.jinja` beside it), the prompts and the warm start's
  demonstrations in `directory`: (tokenizer file, prompts JSONL, demonstrations JSONL)."""
  from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

  from trainer.data.chat import ChatTemplate
  from trainer.rl.tools import schema_of

  os.makedirs(directory, exist_ok=True)
  vocab = {**{t: i for i, t in enumerate(SPECIALS)},
           **{c: i + len(SPECIALS) for i, c in enumerate(CHARACTERS)}}
  tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
  tokenizer.add_special_tokens(list(SPECIALS))
  tokenizer.add_tokens([AddedToken(w, special=False, normalized=False) for w in WORDS])
  tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
  tokenizer.decoder = decoders.Fuse()
  tokenizer_path = os.path.join(directory, "tokenizer.json")
  tokenizer.save(tokenizer_path)
  with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
    json.dump({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, f)
  with open(os.path.join(directory, "chat_template.jinja"), "w") as f:
    f.write(TEMPLATE)
  prompts = os.path.join(directory, "prompts.jsonl")
  with open(prompts, "w") as f:
    for key in KEYS:
      f.write(json.dumps({"prompt": [{"role": "user", "content": f"What is {key}?"}],
                          "key": key}) + "\n")
  template = ChatTemplate(TEMPLATE, {})
  tools = [schema_of(Table.lookup)]
  rng = random.Random(seed)
  demos = os.path.join(directory, "demonstrations.jsonl")
  with open(demos, "w") as f:
    for _ in range(demonstrations):
      key, value = rng.choice(KEYS), str(rng.randrange(10))
      call = {"type": "function", "function": {"name": "lookup", "arguments": {"key": key}}}
      text = template.render([
          {"role": "user", "content": f"What is {key}?"},
          {"role": "assistant", "content": "", "tool_calls": [call]},
          {"role": "tool", "name": "lookup", "content": value},
          {"role": "assistant", "content": value}], tools=tools)
      f.write(json.dumps({"text": text.removesuffix("\n")}) + "\n")
  return tokenizer_path, prompts, demos
