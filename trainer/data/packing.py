"""Documents packed into fixed-length rows, with the segment ids and positions that keep them apart.

A packed batch holds, beside `inputs` and `targets` (`[batch, length]` token ids,
the targets one token on), each token's document and place in it:

- `segment_ids`: 1, 2, ... for the documents of a row in order, 0 for the padding at
  the row's end;
- `positions`: each token's position in its own document (0 at its first token).

The language models (`models.TransformerLM`, `GPT2LM`, `LlamaLM`) take both: attention
stays within a document (`models.attention`) and the position embeddings (learned or
rotary) count from each document's start; `LanguageModelTrainer.loss` averages only
the real tokens. Packing is Grain's first-fit packing
(`grain.experimental.FirstFitPackIterDataset`), MaxText's too.

Every train batch that holds `segment_ids` is checked before its step
(`check_packed`, called by the feed): a segment id that decreases along a row, or is
negative or larger than the row, padding before a document, or positions that do not
count from each document's start are refused, naming the row.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

#: The entries a packed batch adds.
SEGMENT_IDS = "segment_ids"
POSITIONS = "positions"
#: Each target token's weight in the loss (instruction data: 1 for the response's tokens,
#: 0 for the prompt's); a batch without it weighs every real token 1.
LOSS_WEIGHTS = "loss_weights"


class PackingError(ValueError):
  """A packed batch whose segment ids or positions the models cannot take."""


def documents_to_examples(documents: Sequence[Sequence[int]], length: int
                          ) -> list[dict[str, np.ndarray]]:
  """Each document as next-token examples of at most `length` tokens: a document of `n`
  tokens gives `n - 1` (input, target) pairs, cut into pieces of `length`; documents of
  fewer than 2 tokens give none."""
  out = []
  for doc in documents:
    doc = np.asarray(doc, np.int32)
    for start in range(0, len(doc) - 1, length):
      piece = doc[start:start + length + 1]
      if len(piece) >= 2:
        out.append({"inputs": piece[:-1], "targets": piece[1:]})
  return out


def packed_batches(documents: Sequence[Sequence[int]], *, length: int, batch_size: int,
                   seed: int, start_step: int = 0, rows: slice = slice(None),
                   shuffle: bool = True) -> Iterator[dict[str, np.ndarray]]:
  """Endless batches of `batch_size` rows of `length` tokens, each row packed with whole
  documents (a document longer than a row is cut into pieces) by Grain's first-fit packing.

  The documents are shuffled per epoch from `seed`; batch `s` is the same whatever step a
  run starts from (`start_step` skips that many batches), and `rows` picks a process's rows
  of each (`trainer.strategy.process_slice(batch_size)`).
  """
  import grain

  examples = documents_to_examples(documents, length)
  if not examples:
    raise PackingError(f"packed_batches: no document holds 2 or more tokens (got "
                       f"{len(documents)} documents).")
  dataset = grain.MapDataset.source(examples)
  if shuffle:
    dataset = dataset.seed(seed).shuffle()
  dataset = grain.experimental.FirstFitPackIterDataset(
      dataset.repeat().to_iter_dataset(), length_struct={"inputs": length, "targets": length},
      num_packing_bins=batch_size, shuffle_bins=False)
  iterator = iter(dataset.batch(batch_size, drop_remainder=True))
  for _ in range(start_step):
    next(iterator)
  for batch in iterator:
    out = {"inputs": batch["inputs"], "targets": batch["targets"],
           SEGMENT_IDS: batch["inputs_segment_ids"], POSITIONS: batch["inputs_positions"]}
    yield {k: np.asarray(v, np.int32)[rows] for k, v in out.items()}


def check_packed(batch, *, where: str = "the batch") -> None:
  """Raises unless `batch[segment_ids]` (and `batch[positions]`, where given) are what the
  models expect (see the module docstring). A batch without segment ids passes.

  Raises:
    PackingError: naming the entry, the row and the value.
  """
  if not isinstance(batch, dict) or SEGMENT_IDS not in batch:
    return
  seg = np.asarray(batch[SEGMENT_IDS])
  tokens = np.asarray(batch.get("inputs", seg))
  if seg.shape != tokens.shape or seg.ndim != 2:
    raise PackingError(f"{where}: {SEGMENT_IDS!r} has shape {seg.shape}; it must be "
                       f"[batch, length], the shape of 'inputs' {tokens.shape}.")
  if not np.issubdtype(seg.dtype, np.integer):
    raise PackingError(f"{where}: {SEGMENT_IDS!r} has dtype {seg.dtype}; it must hold "
                       f"integers (1, 2, ... per document, 0 for padding).")
  length = seg.shape[1]
  bad = np.argwhere((seg < 0) | (seg > length))
  if bad.size:
    r, c = bad[0]
    raise PackingError(f"{where}: {SEGMENT_IDS!r} row {r} holds {seg[r, c]} at position {c}; "
                       f"segment ids are 0 (padding) or 1..{length} (a row of {length} tokens "
                       f"holds at most {length} documents).")
  real = seg > 0
  steps = np.diff(seg, axis=1)
  for r in range(seg.shape[0]):
    down = np.flatnonzero(real[r, 1:] & (steps[r] < 0))
    if down.size:
      c = down[0] + 1
      raise PackingError(f"{where}: {SEGMENT_IDS!r} row {r} decreases from {seg[r, c - 1]} "
                         f"to {seg[r, c]} at position {c}; the documents of a row are "
                         f"numbered in order (1, 2, ...).")
    late = np.flatnonzero(~real[r, :-1] & real[r, 1:])
    if late.size:
      c = late[0] + 1
      raise PackingError(f"{where}: {SEGMENT_IDS!r} row {r} has padding (0) before "
                         f"document {seg[r, c]} at position {c}; padding goes at the end of "
                         f"a row.")
  if POSITIONS not in batch:
    return
  pos = np.asarray(batch[POSITIONS])
  if pos.shape != seg.shape:
    raise PackingError(f"{where}: {POSITIONS!r} has shape {pos.shape}, not the shape of "
                       f"{SEGMENT_IDS!r} {seg.shape}.")
  starts = np.ones_like(real)
  starts[:, 1:] = seg[:, 1:] != seg[:, :-1]
  index = np.broadcast_to(np.arange(length), seg.shape)
  expect = index - np.maximum.accumulate(np.where(starts, index, 0), axis=1)
  wrong = np.argwhere(real & (pos != expect))
  if wrong.size:
    r, c = wrong[0]
    raise PackingError(f"{where}: {POSITIONS!r} row {r} holds {pos[r, c]} at position {c}, "
                       f"but that token is number {expect[r, c]} of its document (segment "
                       f"{seg[r, c]}); positions count from 0 at each document's start.")
