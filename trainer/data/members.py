"""Each member of an ensemble its own data: many tenants' corpora trained in one program.

`config.data.member_sources` holds one tuple of sources per member (a sweep's or an
ensemble's, in member order) and `config.data.member_eval_sources` one tuple of held-out
sources per member (empty: every member is evaluated on `config.data.eval_sources`).
Member i's corpus is `config.data` with those sources (`member_config`): the same
tokenizer, layout, lanes and seed, so member i reads exactly what its own run would.

A batch is `[members, rows, ...]`, member i's rows from its own corpus, and the strategy
places each member's rows with its state (`Strategy.batch_models`): one step trains every
member on its own rows, and each member's held-out metrics are its own. The position of
every member's corpus is saved with each checkpoint and restored on resume.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import ml_collections
import numpy as np

from trainer.evaluation import MASK_KEY  # Marks real (1) and padding (0) eval rows.


def member_sources(config: ml_collections.ConfigDict) -> tuple[tuple[str, ...], ...]:
  """`config.data.member_sources` as tuples, checked (empty: every member reads
  `config.data.sources`).

  Raises:
    ValueError: an entry that is not a non-empty tuple of sources, naming the field, or
      held-out sources for another count of members.
  """
  data = config.data
  for field in ("member_sources", "member_eval_sources"):
    for i, sources in enumerate(data[field]):
      if isinstance(sources, str) or not len(sources):
        raise ValueError(f"config.data.{field}[{i}]={sources!r} must be a non-empty tuple of "
                         f"sources, one tuple per member, e.g. (('a.jsonl',), ('b.jsonl',)).")
  train, held = tuple(map(tuple, data.member_sources)), tuple(map(tuple,
                                                                  data.member_eval_sources))
  if held and len(held) != len(train):
    raise ValueError(f"config.data.member_eval_sources has {len(held)} entries for the "
                     f"{len(train)} members of config.data.member_sources; give one per "
                     f"member, or none (every member evaluated on config.data.eval_sources).")
  return train


def member_config(config: ml_collections.ConfigDict, i: int) -> ml_collections.ConfigDict:
  """`config` with member i's sources as `config.data.sources` (and its held-out ones as
  `eval_sources`): member i's own run."""
  out = ml_collections.ConfigDict(config.to_dict())
  with out.unlocked():
    out.data.sources = tuple(config.data.member_sources[i])
    if config.data.member_eval_sources:
      out.data.eval_sources = tuple(config.data.member_eval_sources[i])
    out.data.member_sources, out.data.member_eval_sources = (), ()
  return out


class MemberCorpus:
  """The members' corpora as one: `corpus(start_step)` yields batches `[members, rows,
  ...]` (what `fit` takes)."""

  def __init__(self, corpora: Sequence[Any]):
    self.corpora = tuple(corpora)

  def __call__(self, start_step: int = 0) -> MemberIterator:
    return MemberIterator([corpus(start_step) for corpus in self.corpora])


class MemberIterator:
  """Every member's batch of a step, stacked; its position is every member's."""

  def __init__(self, iterators: Sequence[Any]):
    self.iterators = list(iterators)

  def __iter__(self) -> MemberIterator:
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    batches = [next(it) for it in self.iterators]
    return {k: np.stack([b[k] for b in batches]) for k in batches[0]}

  def get_state(self) -> dict[str, Any]:
    return {"members": [it.get_state() for it in self.iterators]}

  def set_state(self, state: dict[str, Any]) -> None:
    for it, own in zip(self.iterators, state["members"], strict=True):
      it.set_state(own)

  def close(self) -> None:
    for it in self.iterators:
      getattr(it, "close", lambda: None)()


def from_config(config: ml_collections.ConfigDict,
                corpus_of: Callable[[ml_collections.ConfigDict], Any]) -> MemberCorpus:
  """Every member's corpus, `corpus_of(member_config(config, i))` (`trainer.data.lm`'s)."""
  return MemberCorpus([corpus_of(member_config(config, i))
                       for i in range(len(member_sources(config)))])


def eval_batches(config: ml_collections.ConfigDict,
                 batches_of: Callable[[ml_collections.ConfigDict], list[dict[str, np.ndarray]]]
                 ) -> list[dict[str, np.ndarray]]:
  """Each member's held-out batches (`batches_of` its own config: `lm.eval_batches`),
  stacked; a member with fewer batches than another gets copies of its last with every
  row masked out (`MASK_KEY`), which no metric counts."""
  own = [batches_of(member_config(config, i)) for i in range(len(member_sources(config)))]
  if not any(own):
    return []
  count = max(len(batches) for batches in own)
  padded = []
  for batches in own:
    masked = {**batches[-1], MASK_KEY: np.zeros(len(batches[-1]["inputs"]), np.float32)}
    padded.append([{MASK_KEY: np.ones(len(b["inputs"]), np.float32), **b} for b in batches]
                  + [masked] * (count - len(batches)))
  return [{k: np.stack([member[j][k] for member in padded]) for k in padded[0][j]}
          for j in range(count)]
