"""Rewards as programs: Python functions of the prompts and their completions, named by
import path, run on the host on the decoded completions.

A reward function takes keyword arguments and returns one finite number per completion,
as TRL's reward functions do::

    def correct_sum(*, prompts, completions, prompt_ids, completion_ids, **_):
      sums = [sum(map(int, p.rstrip("=").split("+"))) for p in prompts]
      return [1.0 if c.strip() == str(s) else 0.0 for s, c in zip(sums, completions)]

`prompts` and `completions` are lists of strings (a prompt repeated for each completion
of its group), `prompt_ids` and `completion_ids` lists of token id lists. A config names
each function as `"package.module:function"` (or `"package.module.function"`), or as
`"path/to/file.py:function"` (a file, relative to the working directory), with a
weight; the total reward is the weighted sum, and each function's mean is logged.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
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
    module_name, sep, attr = spec.rpartition(":")
    if not sep:
      module_name, _, attr = spec.rpartition(".")
    try:
      fn = getattr(_module(module_name), attr)
    except (ImportError, AttributeError, ValueError, OSError) as e:
      raise ValueError(f"{where}: cannot import the reward function {spec!r} ({e}); name it "
                       f"as 'package.module:function', importable from the run.") from e
    if not callable(fn):
      raise ValueError(f"{where}: {spec!r} is a {type(fn).__name__}, not a function.")
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(
        weight):
      raise ValueError(f"{where}_weights: {weight!r} for {spec!r} must be a finite number.")
    out.append(Reward(spec, fn, float(weight)))
  return out


def _module(name: str):
  """A module by import path, or a `.py` file's (loaded once, named after its path)."""
  if not name.endswith(".py"):
    return importlib.import_module(name)
  import os
  import sys
  path = os.path.abspath(name)
  key = f"_reward_file_{abs(hash(path))}"
  if key not in sys.modules:
    spec = importlib.util.spec_from_file_location(key, path)
    if spec is None or not os.path.isfile(path):
      raise ImportError(f"no file {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[key] = module
  return sys.modules[key]


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

