"""A text corpus's position (`trainer.data.lm`): every lane's Grain state, and what the
checkpoint and the metrics do with it, apart from the pipeline so that the checkpoint's
code needs nothing of it but these few lines.

The state's keys: `LANES_KEY`, the lane count (the state is valid for any process layout
that divides it), and `STATES_KEY`, each lane's Grain state by lane; `PROCESS_KEY` marks
the states of one process's lanes only, before `gather_state`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

LANES_KEY = "corpus_lanes"
STATES_KEY = "lane_states"
PROCESS_KEY = "of_process"


def is_process_local(state: Any) -> bool:
  """Whether `state` is one process's lanes' position (to gather before a save)."""
  return isinstance(state, Mapping) and bool(state.get(PROCESS_KEY))


def _walk_skipped(state: Any, totals: dict[str, int]) -> None:
  if isinstance(state, Mapping):
    if "skipped" in state and isinstance(state["skipped"], Mapping) and "epoch" in state:
      for kind, n in state["skipped"].items():
        totals[kind] = totals.get(kind, 0) + int(n)
      return
    for value in state.values():
      _walk_skipped(value, totals)
  elif isinstance(state, (list, tuple)):
    for value in state:
      _walk_skipped(value, totals)


def skipped_counts(state: Any) -> dict[str, int]:
  """Bad records skipped, by the kinds that occur in a corpus state's sources' states,
  summed over its lanes and sources."""
  totals: dict[str, int] = {}
  _walk_skipped(state, totals)
  return totals


def gather_state(state: Any) -> Any:
  """A corpus state of one process's lanes made every process's (a collective: all
  processes call it at the same save); any other state as it is."""
  if not is_process_local(state):
    return state
  from trainer.distributed import agree
  merged: dict[str, Any] = {}
  for states in agree.every_process_json(state[STATES_KEY]):
    merged.update(states)
  return {LANES_KEY: state[LANES_KEY], STATES_KEY: dict(sorted(merged.items(), key=lambda kv:
                                                                   int(kv[0])))}


