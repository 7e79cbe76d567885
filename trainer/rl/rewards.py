"""Rewards as programs: Python functions of the prompts and their completions, named by
import path, run on the host on the decoded completions.

A reward function takes keyword arguments and returns one finite number per completion,
as TRL's reward functions do:

    def correct_sum(*, prompts, completions, prompt_ids, completion_ids, **_):
      return [1.0 if c.strip() == str(eval(p.rstrip("="))) else 0.0
              for p, c in zip(prompts, completions)]

`prompts` and `completions` are lists of strings (a prompt repeated for each completion
of its group), `prompt_ids` and `completion_ids` lists of token id lists. A config names
each function as `"package.module:function"` (or `"package.module.function"`) with a
weight; the total reward is the weighted sum, and each function's mean is logged.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from collections.abc import Callable, Sequence


@dataclasses.dataclass(frozen=True)
class Reward:
  """One reward function and its weight."""

  name: str
  fn: Callable[..., Sequence[float]]
  weight: float = 1.0


def load(specs: Sequence[str], weights: Sequence[float] = (), *,
         where: str = "config.rl.rewards") -> list[Reward]:
  """The functions `specs` name, each with its weight (default 1).

  Raises:
    ValueError: naming the spec, when none is given, one cannot be imported or is not
      callable, or the weights do not match.
  """
  specs = tuple(specs)
  if not specs:
    raise ValueError(f"{where}=() names no reward function; name one or more as "
                     f"'package.module:function'.")
  weights = tuple(weights) or (1.0,) * len(specs)
  if len(weights) != len(specs):
    raise ValueError(f"{where}_weights={weights} has {len(weights)} weights for "
                     f"{len(specs)} reward functions; give one per function, or none.")
  out = []
  for spec, weight in zip(specs, weights, strict=True):
    module_name, sep, attr = spec.partition(":")
    if not sep:
      module_name, _, attr = spec.rpartition(".")
    try:
      fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as e:
      raise ValueError(f"{where}: cannot import the reward function {spec!r} ({e}); name it "
                       f"as 'package.module:function', importable from the run.") from e
    if not callable(fn):
      raise ValueError(f"{where}: {spec!r} is a {type(fn).__name__}, not a function.")
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(
        weight):
      raise ValueError(f"{where}_weights: {weight!r} for {spec!r} must be a finite number.")
    out.append(Reward(spec, fn, float(weight)))
  return out


def score(rewards: Sequence[Reward], *, prompts: list[str], completions: list[str],
          prompt_ids: list[list[int]], completion_ids: list[list[int]]
          ) -> tuple[list[float], dict[str, list[float]]]:
  """The weighted total per completion, and each function's values.

  Raises:
    ValueError: a function that returns other than one finite number per completion,
      naming the function and the value.
  """
  n = len(completions)
  values: dict[str, list[float]] = {}
  for reward in rewards:
    out = reward.fn(prompts=prompts, completions=completions, prompt_ids=prompt_ids,
                    completion_ids=completion_ids)
    try:
      out = list(out)
    except TypeError:
      raise ValueError(f"the reward function {reward.name!r} returned {out!r}; it must "
                       f"return one number per completion ({n}).") from None
    if len(out) != n:
      raise ValueError(f"the reward function {reward.name!r} returned {len(out)} values for "
                       f"{n} completions; it must return one number per completion.")
    for i, value in enumerate(out):
      if (isinstance(value, bool) or not isinstance(value, int | float)
          or not math.isfinite(value)):
        raise ValueError(f"the reward function {reward.name!r} returned {value!r} for "
                         f"completion {i} ({completions[i]!r}); it must be a finite number.")
    values[reward.name] = [float(v) for v in out]
  totals = [sum(r.weight * values[r.name][i] for r in rewards) for i in range(n)]
  return totals, values

