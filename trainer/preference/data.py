"""Preference pairs through the corpus pipeline: one pair a row, tokenized as TRL's DPOTrainer.

A record holds a prompt and two responses, the chosen and the rejected
(`config.preference.prompt_field`, `chosen_field`, `rejected_field`):

- text: three strings. The prompt is `tokenizer(prompt)` and each full sequence
  `tokenizer(prompt + response + eos)`, `tokenizer` bracketing with BOS as the corpus
  does (`trainer.data.corpus.Tokenizer`: the model directory's `add_bos_token`), `eos`
  the EOS token's text (none where the tokenizer has no EOS);
- chat: the responses are lists of turns (`[{"role": "assistant", "content": ...}]`)
  and the prompt a list of turns, or absent, in which case the prompt is the turns the
  two conversations share. The prompt is rendered by the weights' chat template with the
  generation prompt, each full sequence as the whole conversation; both are tokenized as
  rendered, so the only BOS is the template's own.

Either way the response begins where the prompt's ids and the full sequence's stop
sharing a prefix (TRL 1.16's rule: a merge across the boundary moves it into the
prompt). The rows are what the pipeline streams, mixes and resumes exactly, as it does
documents (`trainer.data.lm`), on any process count.

A row holds, for its chosen (index 0) and rejected (index 1) sequences, `[2, length]`
arrays: `inputs` and `targets` (the sequence's tokens and the next ones, padded on the
right), `loss_weights` (1 where the target is a response token), `target_mask` (1 where
the target is a token at all: ORPO's NLL counts the prompt's too), and
`completion_tokens` `[2]` (the responses' token counts after any cut, IPO's lengths).
A sequence holds at most `length + 1` tokens (TRL's `max_length`). Longer, it is cut
at its end (`truncation="keep_start"`, TRL's default) unless its prompt alone fills the
row, or refused (`"refuse"`); a refused pair, a record without the three fields, or
with an empty response is a bad record, named by file and line or skipped and counted
(`config.data.bad_records`), as the corpus's are.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import ml_collections
import numpy as np

from trainer.data import lm
from trainer.data.corpus import Tokenizer

TRUNCATIONS = ("keep_start", "refuse")
#: The batch's keys beyond `inputs` and `targets`.
LOSS_WEIGHTS, TARGET_MASK, COMPLETION_TOKENS = "loss_weights", "target_mask", "completion_tokens"
#: Reference log-probs stored with the data (`trainer.preference.reference.Stored`).
REF_LOGPS = "ref_logps"


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
  """How many leading ids `a` and `b` share."""
  n = 0
  for x, y in zip(a, b, strict=False):
    if x != y:
      break
    n += 1
  return n


def _is_turns(value: Any) -> bool:
  return isinstance(value, list) and all(
      isinstance(m, Mapping) and isinstance(m.get("role"), str)
      and isinstance(m.get("content"), str) for m in value)


def _fields_wrong(record: Mapping, fields: Sequence[str]) -> str:
  """What a record lacks among `fields`: the missing ones, else each one's type."""
  missing = [f for f in fields if f not in record]
  if missing:
    return (f"no {' and no '.join(map(repr, missing))} field (its fields: "
            f"{', '.join(map(repr, record)) or 'none'})")
  kinds = ", ".join(f"{f!r} {'turns' if _is_turns(record[f]) else type(record[f]).__name__}"
                    for f in fields)
  return f"fields of kinds that do not pair ({kinds})"


class PairEncoder:
  """A preference record as one row (`corpus.ShardIterator`'s `encode`).

  Args:
    tokenizer: the run's tokenizer (its chat template for chat records).
    length: the row's width (`config.seq_len`).
    truncation: one of `TRUNCATIONS`.
    fields: the record's prompt, chosen and rejected fields.
  """

  KINDS = ("missing_pair", "empty_response", "too_long")

  def __init__(self, tokenizer: Tokenizer, *, length: int, truncation: str = "keep_start",
               fields: tuple[str, str, str] = ("prompt", "chosen", "rejected")):
    self.tokenizer, self.length, self.truncation, self.fields = (tokenizer, length, truncation,
                                                                 fields)
    eos = tokenizer.eos_id
    self.eos_text = tokenizer.tokenizer.id_to_token(eos) if eos is not None else ""
    self.pad_id = eos if eos is not None else 0

  def describe(self, kind: str, record: Any = None) -> str:
    prompt, chosen, rejected = self.fields
    if kind == "missing_pair" and isinstance(record, Mapping):
      return f"has {_fields_wrong(record, self.fields)}; a pair is text {prompt!r}, " \
             f"{chosen!r} and {rejected!r} fields, or {chosen!r} and {rejected!r} lists of " \
             f"turns (and a prompt of turns, or none)"
    return {"missing_pair": f"has no text {prompt!r}, {chosen!r} and {rejected!r} fields "
                            f"(nor {chosen!r} and {rejected!r} lists of turns)",
            "empty_response": f"has an empty {chosen!r} or {rejected!r} response",
            "too_long": f"is a pair longer than config.seq_len + 1 = {self.length + 1} tokens "
                        f"(config.preference.truncation={self.truncation!r}"
                        + (")" if self.truncation == "refuse" else
                           ": its prompt alone fills the row)")}[kind]

  # -- Tokens ------------------------------------------------------------------------------

  def _text_ids(self, text: str) -> list[int]:
    return self.tokenizer.encode_text(text)

  def _rendered_ids(self, messages, *, add_generation_prompt: bool = False) -> list[int]:
    text = self.tokenizer.chat_template().render(messages,
                                                 add_generation_prompt=add_generation_prompt)
    return self.tokenizer.tokenizer.encode(text, add_special_tokens=False).ids

  def tokenize(self, record: Any) -> tuple[str | None, tuple[list[int], ...]]:
    """`(None, (prompt ids, chosen ids, rejected ids))`, the responses' ids following the
    prompt's; or `(bad kind, ())`."""
    if not isinstance(record, Mapping):
      return "missing_pair", ()
    p_field, c_field, r_field = self.fields
    prompt, chosen, rejected = (record.get(f) for f in self.fields)
    if isinstance(chosen, str) and isinstance(rejected, str) and isinstance(prompt, str):
      if not chosen.strip() or not rejected.strip():
        return "empty_response", ()
      prompt_ids = self._text_ids(prompt)
      full = [self._text_ids(prompt + r + ("" if r.endswith(self.eos_text) else self.eos_text))
              for r in (chosen, rejected)]
    elif _is_turns(chosen) and _is_turns(rejected) and (prompt is None or _is_turns(prompt)):
      if prompt is None:  # The turns both conversations share are the prompt.
        n = 0
        while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
          n += 1
        prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
      if (not prompt or not chosen or not rejected
          or not all(m["content"].strip() for m in (*chosen, *rejected))):
        return ("missing_pair" if not prompt else "empty_response"), ()
      prompt_ids = self._rendered_ids(prompt, add_generation_prompt=True)
      full = [self._rendered_ids(list(prompt) + list(r)) for r in (chosen, rejected)]
    else:
      return "missing_pair", ()
    start = min(common_prefix(prompt_ids, full[0]), common_prefix(prompt_ids, full[1]))
    responses = tuple(ids[start:] for ids in full)
    if not all(responses):
      return "empty_response", ()
    return None, (prompt_ids[:start], *responses)

  # -- Rows ----------------------------------------------------------------------------------

  def __call__(self, record: Any) -> tuple[str | None, list[dict[str, np.ndarray]]]:
    kind, ids = self.tokenize(record)
    if kind is not None:
      return kind, []
    prompt, *responses = ids
    most = self.length + 1
    if len(prompt) >= most or (self.truncation == "refuse"
                               and len(prompt) + max(map(len, responses)) > most):
      return "too_long", []
    row = {"inputs": np.full((2, self.length), self.pad_id, np.int32),
           "targets": np.full((2, self.length), self.pad_id, np.int32),
           LOSS_WEIGHTS: np.zeros((2, self.length), np.float32),
           TARGET_MASK: np.zeros((2, self.length), np.float32),
           COMPLETION_TOKENS: np.zeros((2,), np.float32)}
    for i, response in enumerate(responses):
      sequence = (prompt + response)[:most]  # keep_start: the end cut.
      weights = ([0.0] * len(prompt) + [1.0] * len(response))[:most]
      n = len(sequence) - 1
      row["inputs"][i, :n] = sequence[:-1]
      row["targets"][i, :n] = sequence[1:]
      row[LOSS_WEIGHTS][i, :n] = weights[1:]
      row[TARGET_MASK][i, :n] = 1.0
      row[COMPLETION_TOKENS][i] = sum(weights)
    return None, [row]


def check_config(config: ml_collections.ConfigDict, *, sources: bool = False) -> None:
  """Raises for a `config.preference` data field the pipeline cannot take (and, with
  `sources`, for no `config.data.sources`)."""
  spec = config.preference
  if spec.truncation not in TRUNCATIONS:
    raise ValueError(f"config.preference.truncation={spec.truncation!r} is not one of "
                     f"{TRUNCATIONS}.")
  if sources and not config.data.sources:
    raise ValueError("config.data.sources is empty: preference training reads pairs from "
                     "JSONL or Parquet files ({prompt, chosen, rejected} records).")
  if config.data.chat:
    raise ValueError("config.data.chat=True with config.preference: a preference record "
                     "is chat or text by its own fields (lists of turns, or strings); "
                     "leave config.data.chat False.")


def check_schemas(sources, config: ml_collections.ConfigDict) -> None:
  """Reads each Parquet file's schema (its footer) before any compute: under
  `bad_records="stop"` a file without the chosen and rejected columns is refused."""
  from trainer.data.records import CorpusError, format_of
  if config.data.bad_records != "stop":
    return
  import pyarrow.parquet as pq
  spec = config.preference
  for path in (f for s in sources for f in s.files if format_of(f) == "parquet"):
    names = pq.read_schema(path).names
    missing = [f for f in (spec.chosen_field, spec.rejected_field) if f not in names]
    if missing:
      raise CorpusError(f"{path}: no column {missing[0]!r} (its columns: {names}); every "
                        f"file of preference pairs holds config.preference.chosen_field and "
                        f"rejected_field. config.data.bad_records='stop'.")


def encoder(config: ml_collections.ConfigDict, tokenizer: Tokenizer) -> PairEncoder:
  spec = config.preference
  return PairEncoder(tokenizer, length=config.seq_len, truncation=spec.truncation,
                     fields=(spec.prompt_field, spec.chosen_field, spec.rejected_field))


def from_config(config: ml_collections.ConfigDict, rows: slice = slice(None),
                epochs: int | None = None, *, held_out: bool = False) -> lm.Corpus:
  """The pairs of `config.data.sources` (`held_out`: one ordered pass over `eval_sources`,
  `lm.held_out_config`), this process's `rows` of each batch, endless or `epochs` passes:
  what `fit` takes."""
  check_config(config, sources=not held_out)
  run = lm.held_out_config(config) if held_out else config
  resolved = lm.check_config(run, schemas=False)
  check_schemas(resolved, config)
  tokenizer = lm.tokenizer_of(run)
  data = run.data
  return lm.Corpus(resolved, tokenizer, length=config.seq_len, batch_size=run.batch_size,
                   rows=rows, lanes=data.lanes, bad_records=data.bad_records,
                   shuffle_files=data.shuffle_files, seed=config.seed, epochs=epochs,
                   workers=data.workers if epochs is None else 0,
                   worker_buffer=data.worker_buffer, encode=encoder(config, tokenizer))


def eval_batches(config: ml_collections.ConfigDict) -> list[dict[str, np.ndarray]]:
  """Up to `config.data.eval_batches` batches of `config.eval_batch_size` pairs from one
  pass over `config.data.eval_sources`, in order, the same on every process; [] without
  eval sources."""
  if not config.data.eval_sources:
    return []
  return lm.first_batches(from_config(config, epochs=1, held_out=True)(), config, "pairs")


def example_batch(config: ml_collections.ConfigDict) -> dict[str, np.ndarray]:
  """One batch of the shapes a preference config trains on (`config.batch_size` pairs of
  `config.seq_len` tokens, with stored reference log-probs under
  `reference="precomputed"`): what the dry run (`python -m trainer.plan`) compiles."""
  shape = (config.batch_size, 2, config.seq_len)
  batch = {"inputs": np.zeros(shape, np.int32), "targets": np.zeros(shape, np.int32),
           LOSS_WEIGHTS: np.ones(shape, np.float32), TARGET_MASK: np.ones(shape, np.float32),
           COMPLETION_TOKENS: np.full(shape[:2], config.seq_len, np.float32)}
  if config.preference.reference == "precomputed":
    batch[REF_LOGPS] = np.zeros(shape[:2], np.float32)
  return batch
