"""Prompts through the corpus pipeline: one prompt a row, for RL's rollouts.

A record holds a prompt (`config.rl.prompt_field`): text, tokenized as the corpus
tokenizes (BOS as the tokenizer adds it, no EOS), or a list of turns rendered by the
weights' chat template with the generation prompt. A row holds `prompt_ids`
(`[config.rl.max_prompt_length]`, right-padded), `prompt_lengths` and `record`: the
whole record as UTF-8 JSON, zero-padded to `config.rl.max_record_bytes`, which the
rewards get back (`records_of`): its prompt as written, and every other field as a
keyword argument, as TRL passes a dataset's columns. A record without the field, whose
prompt is longer than the row, or whose JSON is longer than `max_record_bytes`, is a bad
record, named by file and line or skipped and counted (`config.data.bad_records`), as
the corpus's are. The rows stream, mix and resume exactly on any number of processes as
documents do (`trainer.data.lm`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import ml_collections
import numpy as np

from trainer.data import lm
from trainer.data.corpus import Tokenizer

PROMPT_IDS, PROMPT_LENGTHS, RECORD = "prompt_ids", "prompt_lengths", "record"


def _plain(value: Any) -> Any:
  """A Parquet value JSON can hold (numpy scalars and arrays as numbers and lists)."""
  return value.tolist() if hasattr(value, "tolist") else str(value)


def record_bytes(record: Mapping[str, Any]) -> bytes:
  """A record as the UTF-8 JSON a row holds."""
  return json.dumps(dict(record), ensure_ascii=False, default=_plain).encode("utf-8")


def records_of(rows: np.ndarray) -> list[dict[str, Any]]:
  """The records of a batch's `record` rows (`[rows, max_record_bytes]` uint8)."""
  rows = np.asarray(rows, np.uint8)
  return [json.loads(bytes(row).rstrip(b"\0").decode("utf-8")) for row in rows]


class PromptEncoder:
  """A prompt record as one row (`corpus.ShardIterator`'s `encode`)."""

  def __init__(self, tokenizer: Tokenizer, *, length: int, field: str = "prompt",
               record_length: int = 4096, tools: list[dict] | None = None):
    self.tokenizer, self.length, self.field = tokenizer, length, field
    self.tools = tools
    self.record_length = record_length
    self.pad_id = tokenizer.eos_id if tokenizer.eos_id is not None else 0

  def describe(self, kind: str, record: Any = None) -> str:
    if kind == "missing_prompt" and isinstance(record, Mapping) and self.field not in record:
      return (f"has no prompt field {self.field!r} (its fields: "
              f"{', '.join(map(repr, record)) or 'none'}; config.rl.prompt_field names it)")
    return {"missing_prompt": f"has no prompt {self.field!r} (text, or a list of turns)",
            "too_long": f"holds a prompt longer than config.rl.max_prompt_length="
                        f"{self.length} tokens",
            "record_too_long": f"is longer than config.rl.max_record_bytes="
                               f"{self.record_length} bytes as JSON (the rewards get the "
                               f"whole record)"}[kind]

  def ids(self, prompt: Any) -> list[int] | None:
    """A prompt's token ids (None: not a prompt). With tools, a prompt is rendered by the
    chat template with their schemas (a text prompt as one user turn), as the rollout
    renders it (`trainer.rl.episodes`)."""
    if self.tools and isinstance(prompt, str) and prompt:
      prompt = [{"role": "user", "content": prompt}]
    if isinstance(prompt, str) and prompt:
      return self.tokenizer.encode_text(prompt)
    if isinstance(prompt, list) and prompt and all(
        isinstance(m, Mapping) and isinstance(m.get("content"), str) for m in prompt):
      text = self.tokenizer.chat_template().render(prompt, add_generation_prompt=True,
                                                   tools=self.tools)
      return self.tokenizer.tokenizer.encode(text, add_special_tokens=False).ids
    return None

  def __call__(self, record: Any) -> tuple[str | None, list[dict[str, np.ndarray]]]:
    ids = self.ids(record.get(self.field)) if isinstance(record, Mapping) else None
    if not ids:
      return "missing_prompt", []
    if len(ids) > self.length:
      return "too_long", []
    data = record_bytes(record)
    if len(data) > self.record_length:
      return "record_too_long", []
    row = np.full((self.length,), self.pad_id, np.int32)
    row[:len(ids)] = ids
    text = np.zeros((self.record_length,), np.uint8)
    text[:len(data)] = np.frombuffer(data, np.uint8)
    return None, [{PROMPT_IDS: row, PROMPT_LENGTHS: np.int32(len(ids)), RECORD: text}]


def from_config(config: ml_collections.ConfigDict, rows: slice = slice(None),
                epochs: int | None = None, *, eval_set: bool = False) -> lm.Corpus:
  """The prompts of `config.data.sources` (`eval_set`: of `eval_sources`, one pass in
  order), this process's `rows` of each batch: what `fit` takes."""
  from trainer.rl import tools as tools_lib
  toolbox = tools_lib.load(tuple(config.rl.tools),
                           config.rl.environment or None)
  return records_corpus(
      config, lambda tokenizer: PromptEncoder(
          tokenizer, length=config.rl.max_prompt_length, field=config.rl.prompt_field,
          record_length=config.rl.max_record_bytes,
          tools=toolbox.schemas if toolbox else None),
      rows, epochs, eval_set=eval_set, what="RL", holds="{prompt: ...}")


def records_corpus(config: ml_collections.ConfigDict, encoder, rows: slice = slice(None),
                   epochs: int | None = None, *, eval_set: bool = False, what: str,
                   holds: str) -> lm.Corpus:
  """The rows `encoder(tokenizer)` makes of the records of `config.data.sources`
  (`eval_set`: of `eval_sources`, one pass in order), this process's `rows` of each
  batch; `what` reads records that `holds` (for the error of an empty source list)."""
  data = config.data
  run = lm.held_out_config(config) if eval_set else config
  epochs = 1 if eval_set else epochs
  if not run.data.sources:
    raise ValueError(f"config.data.sources is empty: {what} reads its prompts from JSONL or "
                     f"Parquet files ({holds} records).")
  resolved = lm.check_config(run, schemas=False)
  tokenizer = lm.tokenizer_of(config)
  return lm.Corpus(resolved, tokenizer, length=config.seq_len, batch_size=run.batch_size,
                   rows=rows, lanes=run.data.lanes, bad_records=data.bad_records,
                   shuffle_files=run.data.shuffle_files, seed=config.seed,
                   epochs=epochs, workers=run.data.workers if epochs is None else 0,
                   worker_buffer=data.worker_buffer, encode=encoder(tokenizer))


def eval_batches(config: ml_collections.ConfigDict) -> list[dict[str, np.ndarray]]:
  """Up to `config.data.eval_batches` batches of held-out prompts; [] without any."""
  if not config.data.eval_sources:
    return []
  return lm.first_batches(from_config(config, eval_set=True)(), config, "prompts")


def example_batch(config: ml_collections.ConfigDict) -> dict[str, np.ndarray]:
  """One batch of prompts of the shapes an RL config trains on (the dry run's)."""
  return {PROMPT_IDS: np.ones((config.batch_size, config.rl.max_prompt_length), np.int32),
          PROMPT_LENGTHS: np.ones((config.batch_size,), np.int32),
          RECORD: np.zeros((config.batch_size, config.rl.max_record_bytes), np.uint8)}
