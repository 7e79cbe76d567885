"""How many train steps each compiled call runs (`config.steps_per_call`).

A call runs `steps_per_call` steps, unless an action needs the state at a
step before that: a checkpoint every 10 steps with 4 steps a call is written
at step 10, not 12. Such steps are each action's `next_boundary`; the run's
last step is one too. Between two boundaries the plan runs whole calls, then
one shorter call to land on the boundary. Two call lengths are compiled at
most: `steps_per_call`, and one shorter `unit` that every gap's remainder is
made of (the remainder itself when all gaps leave the same one, as periodic
boundaries do; else their greatest common divisor, in several calls).

Reporting train metrics needs no boundary: a call's outputs hold each of
its steps, and `ReportMetrics` writes them per step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from trainer.loop.actions import Action

#: Boundaries looked at to choose the shorter call length; past this many
#: (an action every step over a long run), the remainder is run a step at a time.
MAX_BOUNDARIES = 100_000


def boundaries(actions: Sequence[Action], start: int, num_steps: int) -> list[int]:
  """The sorted steps in `(start, num_steps]` at which a call must end."""
  steps = {num_steps}
  for action in actions:
    step = start
    while (b := action.next_boundary(step)) is not None and b < num_steps:
      if b <= step:
        raise ValueError(f"{action.name}.next_boundary({step}) returned {b}: it must be a "
                         f"later step, or None.")
      steps.add(b)
      if len(steps) > MAX_BOUNDARIES:
        return sorted(steps)
      step = b
  return sorted(s for s in steps if s > start)


class ChunkPlan:
  """The length of each compiled call of a run, from its actions' boundaries.

  Args:
    steps_per_call: the longest call.
    start: the run's first step.
    num_steps: the step the run ends at.
    actions: the run's actions (their `next_boundary`).
  """

  def __init__(self, steps_per_call: int, *, start: int, num_steps: int,
               actions: Sequence[Action]):
    self.steps_per_call, self.num_steps = steps_per_call, num_steps
    self.actions = list(actions)
    marks = boundaries(self.actions, start, num_steps)
    gaps = [b - a for a, b in zip([start, *marks], marks, strict=False)]
    remainders = {g % steps_per_call for g in gaps} - {0}
    if not remainders:
      self.unit = steps_per_call
    elif len(marks) > MAX_BOUNDARIES:
      self.unit = 1
    elif len(remainders) == 1:
      self.unit = next(iter(remainders))
    else:
      self.unit = math.gcd(steps_per_call, *gaps)
    #: The call lengths the plan uses (each is compiled once).
    self.sizes = sorted({steps_per_call, self.unit} if remainders else {steps_per_call})

  def until(self, step: int) -> int:
    """The first step after `step` at which a call must end."""
    ends = [self.num_steps]
    for action in self.actions:
      b = action.next_boundary(step)
      if b is not None:
        ends.append(b)
    return min(ends)

  def size(self, step: int) -> int:
    """How many steps the call that starts at `step` runs."""
    left = self.until(step) - step
    if left >= self.steps_per_call:
      return self.steps_per_call
    return min(self.unit, left)
