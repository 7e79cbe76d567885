"""Distillation's records through the corpus pipeline: a prompt and, optionally, a
completion a row.

A record holds a prompt (`config.distill.prompt_field`: text, or a list of turns rendered
by the weights' chat template with the generation prompt, as RL's prompts are,
`trainer.rl.data.PromptEncoder`) and a completion (`completion_field`): text, whose ids
are those of `prompt + completion + eos` after the prompt's (TRL's rule: a merge across
the boundary moves into the prompt), or a list of assistant turns, whose ids are the
whole conversation's rendering after the prompt's. A completion longer than
`max_completion_length` is cut at its end. The records' completions are the batches GKD's
`lmbda` leaves off-policy; with `lmbda = 1` (every batch the student's own samples, TRL
DistillationTrainer's) a record needs no completion.

A row holds `prompt_ids` (right-padded), `prompt_lengths`, `completion_ids` (right-padded)
and `completion_lengths` (0: none). A record without a prompt, with a prompt longer than
`max_prompt_length`, or without a completion where one is needed, is a bad record, named
by file and line or skipped and counted (`config.data.bad_records`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import ml_collections
import numpy as np

from trainer.data import lm
from trainer.data.corpus import Tokenizer
from trainer.preference.data import common_prefix
from trainer.rl import data as rl_data
from trainer.rl.data import PROMPT_IDS, PROMPT_LENGTHS

COMPLETION_IDS, COMPLETION_LENGTHS = "completion_ids", "completion_lengths"


class DistillEncoder(rl_data.PromptEncoder):
  """A distillation record as one row (`corpus.ShardIterator`'s `encode`)."""

  def __init__(self, tokenizer: Tokenizer, *, length: int, completion_length: int,
               field: str = "prompt", completion_field: str = "completion",
               needs_completion: bool = True):
    super().__init__(tokenizer, length=length, field=field)
    self.completion_length, self.completion_field = completion_length, completion_field
    self.needs_completion = needs_completion
    eos = tokenizer.eos_id
    self.eos_text = tokenizer.tokenizer.id_to_token(eos) if eos is not None else ""

  def describe(self, kind: str, record: Any = None) -> str:
    if kind == "missing_completion":
      return (f"has no completion {self.completion_field!r} (text, or a list of assistant "
              f"turns); config.distill.lmbda < 1 trains on the records' completions")
    return super().describe(kind, record).replace("config.rl.", "config.distill.")

  def completion(self, prompt: Any, completion: Any, prompt_ids: list[int]
                 ) -> list[int] | None:
    """The completion's ids after the prompt's (None: not a completion)."""
    if isinstance(prompt, str) and isinstance(completion, str) and completion:
      eos = "" if completion.endswith(self.eos_text) else self.eos_text
      full = self.tokenizer.encode_text(prompt + completion + eos)
    elif isinstance(prompt, list) and isinstance(completion, list) and completion and all(
        isinstance(m, Mapping) and isinstance(m.get("content"), str) for m in completion):
      text = self.tokenizer.chat_template().render(prompt + completion)
      full = self.tokenizer.tokenizer.encode(text, add_special_tokens=False).ids
    else:
      return None
    return full[common_prefix(prompt_ids, full):]

  def __call__(self, record: Any) -> tuple[str | None, list[dict[str, np.ndarray]]]:
    prompt = record.get(self.field) if isinstance(record, Mapping) else None
    ids = self.ids(prompt)
    if not ids:
      return "missing_prompt", []
    if len(ids) > self.length:
      return "too_long", []
    completion = self.completion(prompt, record.get(self.completion_field), ids)
    if not completion and self.needs_completion:
      return "missing_completion", []
    completion = (completion or [])[:self.completion_length]
    row = np.full((self.length,), self.pad_id, np.int32)
    row[:len(ids)] = ids
    done = np.full((self.completion_length,), self.pad_id, np.int32)
    done[:len(completion)] = completion
    return None, [{PROMPT_IDS: row, PROMPT_LENGTHS: np.int32(len(ids)), COMPLETION_IDS: done,
                   COMPLETION_LENGTHS: np.int32(len(completion))}]


def from_config(config: ml_collections.ConfigDict, rows: slice = slice(None),
                epochs: int | None = None, *, eval_set: bool = False) -> lm.Corpus:
  """The records of `config.data.sources` (`eval_set`: `eval_sources`, one pass in order),
  this process's `rows` of each batch: what `fit` takes."""
  spec = config.distill
  return rl_data.records_corpus(
      config, lambda tokenizer: DistillEncoder(
          tokenizer, length=spec.max_prompt_length, completion_length=spec.max_completion_length,
          field=spec.prompt_field, completion_field=spec.completion_field,
          needs_completion=spec.lmbda < 1 or eval_set),
      rows, epochs, eval_set=eval_set, what="distillation",
      holds="{prompt: ..., completion: ...}")


def eval_batches(config: ml_collections.ConfigDict) -> list[dict[str, np.ndarray]]:
  """Up to `config.data.eval_batches` batches of held-out records; [] without any."""
  if not config.data.eval_sources:
    return []
  return lm.first_batches(from_config(config, eval_set=True)(), config, "records")


def example_batch(config: ml_collections.ConfigDict) -> dict[str, np.ndarray]:
  """One batch of the shapes a distillation config trains on (the dry run's)."""
  spec, rows = config.distill, config.batch_size
  return {PROMPT_IDS: np.ones((rows, spec.max_prompt_length), np.int32),
          PROMPT_LENGTHS: np.ones((rows,), np.int32),
          COMPLETION_IDS: np.ones((rows, spec.max_completion_length), np.int32),
          COMPLETION_LENGTHS: np.ones((rows,), np.int32)}
