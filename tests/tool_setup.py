"""The multi-turn RL tests' files: tool-capable tokenizers as `transformers` saves them
(TRL 1.16's own Qwen 2.5 and Llama 3.2 chat templates, so TRL reads their tool calls), a
table the model can only read through a tool, and its records and config."""

from __future__ import annotations

import json
import pathlib

import trl

TEMPLATES = pathlib.Path(trl.__file__).parent / "chat_templates"
#: The table behind the `lookup` tool: a key's value is known only by calling it.
TABLE = {"ash": "7", "elm": "3", "fir": "9", "oak": "4", "yew": "6", "bay": "1"}
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN_ADDED = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
LLAMA_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                  "<|eot_id|>", "<|finetune_right_pad_id|>", "<|python_tag|>"]


def lookup(key: str) -> str:
  """The table's value for a key.

  Args:
    key: the row of the table to read.
  """
  if key not in TABLE:
    raise KeyError(f"no row {key!r}")
  return TABLE[key]


class TableEnv:
  """A table environment: `reset` names the asked key; its `lookup` reads the table and
  `get_reward` is 1 where the last answer is the asked value."""

  def reset(self, key: str = "", **kwargs) -> str | None:
    self.key, self.reads, self.answer = key, 0, None
    return None

  def lookup(self, key: str) -> str:
    """The table's value for a key.

    Args:
      key: the row of the table to read.
    """
    self.reads += 1
    return lookup(key)

  def get_reward(self) -> float:
    return float(self.reads > 0)


def _corpus() -> list[str]:
  texts = [(TEMPLATES / "qwen2_5.jinja").read_text(), (TEMPLATES / "llama3_2.jinja").read_text()]
  for key, value in TABLE.items():
    texts.append(f'<tool_call>\n{{"name": "lookup", "arguments": {{"key": "{key}"}}}}\n'
                 f'</tool_call> {{"name": "lookup", "parameters": {{"key": "{key}"}}}} '
                 f"What is {key}? The value of {key} is {value}. {{'error': \"no row\"}}")
  texts.append(json.dumps({"type": "function", "function": {
      "name": "lookup", "description": "The table's value for a key.", "parameters": {
          "type": "object", "properties": {"key": {"type": "string", "description":
                                                     "the row of the table to read."}},
          "required": ["key"]}}}))
  return texts


def save(kind: str, directory: pathlib.Path) -> pathlib.Path:
  """A `qwen` or `llama` tokenizer, with TRL's chat template of that family, saved by
  `transformers`' `save_pretrained` into `directory`."""
  import transformers
  from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

  specials = QWEN_SPECIALS if kind == "qwen" else LLAMA_SPECIALS
  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  tokenizer.train_from_iterator(_corpus() * 5, trainers.BpeTrainer(
      vocab_size=500, special_tokens=specials,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
  if kind == "qwen":
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN_ADDED])
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = (TEMPLATES / "qwen2_5.jinja").read_text()
  else:
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
        pad_token="<|finetune_right_pad_id|>")
    fast.chat_template = (TEMPLATES / "llama3_2.jinja").read_text()
  fast.save_pretrained(str(directory))
  return directory


def write_records(path: pathlib.Path, keys=tuple(TABLE)) -> str:
  """One record per key: a conversation asking the key's value, the `key` and `answer`."""
  with open(path, "w") as f:
    for key in keys:
      f.write(json.dumps({"prompt": [{"role": "user", "content": f"What is {key}?"}],
                          "key": key, "answer": TABLE[key]}) + "\n")
  return str(path)


def config(directory: pathlib.Path, records: str, layout: str = "single_device",
           **overrides):
  """A tiny transformer from scratch on `records` with the tokenizer in `directory`, the
  `lookup` tool (or `overrides`), 2 prompts x G=2 a step."""
  from tokenizers import Tokenizer

  from configs import lm, rl
  cfg = rl.get_config("addition")
  vocab = Tokenizer.from_file(str(directory / "tokenizer.json")).get_vocab_size()
  cfg.model.update(vocab_size=vocab, max_len=1024, num_layers=1, embed_dim=32, num_heads=4,
                   head_dim=8, mlp_dim=64)
  cfg.data.update(sources=(records,), eval_sources=(records,),
                  tokenizer=str(directory / "tokenizer.json"), workers=0, lanes=1)
  cfg.update(batch_size=2, eval_batch_size=2, num_train_steps=2, log_every_steps=1000,
             seq_len=8)
  cfg.rl.update(num_generations=2, max_prompt_length=768, max_completion_length=64,
                tools=(f"{__file__}:lookup",), rewards=(f"{__file__}:answered",),
                log_completions=0)
  if layout != "single_device":
    shape, axes, rules = lm.LAYOUTS[layout]
    cfg.strategy.update(name="sharded_data_parallel", mesh_shape=shape, mesh_axes=axes,
                        logical_axis_rules=rules)
  cfg.update_from_flattened_dict(overrides)
  return cfg


def answered(completions, answer, **kwargs):
  """1 where the last assistant turn holds the record's answer."""
  out = []
  for turns, want in zip(completions, answer, strict=True):
    last = [m for m in turns if m["role"] == "assistant"][-1]["content"]
    out.append(float(want in last))
  return out


def save_model(directory: pathlib.Path, family: str = "llama") -> pathlib.Path:
  """A tiny random `transformers` Llama (or Qwen2) over the tokenizer in `directory`,
  saved beside it (what TRL's trainer loads)."""
  import torch
  import transformers
  from tokenizers import Tokenizer

  torch.manual_seed(0)
  vocab = Tokenizer.from_file(str(directory / "tokenizer.json")).get_vocab_size()
  kind = transformers.Qwen2Config if family == "qwen2" else transformers.LlamaConfig
  config = kind(
      vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
      tie_word_embeddings=False)
  transformers.AutoModelForCausalLM.from_config(config).save_pretrained(str(directory))
  return directory


def script_policy(script):
  """`trainer.rl.multi_turn.scripted`: row r's k-th turn is `script[r][k]`."""
  from trainer.rl.multi_turn import scripted
  return scripted(script)


def calling_policy(trainer, key: str = "ash"):
  """A policy whose first turn calls `lookup(key)` and which samples from the model's
  logits after it (`MultiTurn(policy=...)`): every rollout takes a tool turn."""
  import jax.numpy as jnp

  from trainer.generation import choose
  call = trainer.tokenizer.tokenizer.encode(
      f'<tool_call>\n{{"name": "lookup", "arguments": {{"key": "{key}"}}}}\n</tool_call>'
      f"<|im_end|>", add_special_tokens=False).ids
  rows = trainer.config.batch_size * trainer.rl.num_generations
  scripted = script_policy([[call]] * rows)
  vocab = trainer.config.model.vocab_size

  def policy(logits, keys, t, new, tool):
    sampled = choose(logits[:, :vocab], keys, t, trainer.sampling)
    return jnp.where(~jnp.any(tool, axis=1), scripted(logits, keys, t, new, tool), sampled)

  return policy


def table_config(task_dir: str):
  """`configs/rl.py:tools` from scratch (no warm start), small: the table task's files in
  `task_dir`, 2 prompts x G=2 a step, single_device."""
  import sys
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
  import tool_tasks

  from configs import rl
  tokenizer, prompts, _ = tool_tasks.write_task(task_dir, demonstrations=1)
  config = rl.get_config("tools")
  del config["warm_start"]
  config.data.update(sources=(prompts,), eval_sources=(prompts,), tokenizer=tokenizer,
                     workers=0, lanes=1)
  config.update(batch_size=2, eval_batch_size=2, num_train_steps=2, log_every_steps=1000)
  config.rl.update(num_generations=2, max_completion_length=64, log_completions=0)
  return config
