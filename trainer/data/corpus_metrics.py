"""The corpus's bad-record counts as metrics: `CorpusMetrics`, the action the LM examples
add (`trainer.data.lm` re-exports both names)."""

from __future__ import annotations

from typing import Any

from trainer.data import corpus as corpus_lib
from trainer.data.positions import gather_state, skipped_counts
from trainer.loop.actions import Action


def skipped_records(state: Any) -> dict[str, int]:
  """Bad records skipped, by kind (every kind of `corpus.BAD_KINDS`), summed over the lanes
  and sources of a corpus state."""
  return {**dict.fromkeys(corpus_lib.BAD_KINDS, 0), **skipped_counts(state)}


class CorpusMetrics(Action):
  """Writes the bad records skipped so far, by kind, summed over every process's lanes
  (`data/skipped_<kind>`), so that none is dropped silently: every kind at the first
  write, then a kind when its count has changed (checked every `every_steps` and at the
  end), so a clean corpus logs its zeros once. It gathers the processes' counts: every
  process runs it at the same steps (the loop's schedule)."""

  def __init__(self, writer, *, every_steps: int):
    super().__init__(every_steps=every_steps)
    self.writer = writer
    self._written: dict[str, int] | None = None  # What this run wrote last, by kind.

  def triggers(self, view) -> bool:
    return bool(view.crossed(self.every_steps)) or view.is_last

  def next_boundary(self, step: int) -> None:
    return None  # Cumulative counts: any step after a boundary reports them.

  def run(self, view) -> None:
    counts = skipped_records(gather_state(view.data_state))
    changed = {k: v for k, v in counts.items()
               if self._written is None or self._written.get(k) != v}
    if changed:
      self.writer.write_scalars(view.step, {f"data/skipped_{k}": v for k, v in changed.items()})
    self._written = dict(counts)
