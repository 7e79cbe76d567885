"""Rewards as programs: Python functions of the prompts, their completions and the prompt
records, named by import path, run on the host. They are called as TRL 1.16 calls its
reward functions, so a TRL reward runs here unchanged::

    def correct(completions, answer, **kwargs):
      return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]

Each function gets keyword arguments, one list entry per completion (a prompt's entries
repeated for each completion of its group):

- `prompts`: the record's prompt as written (`config.rl.prompt_field`): a string, or a
  conversation's list of turns;
- `completions`: the decoded completions; for a conversation, each is
  `[{"role": "assistant", "content": text}]`;
- `completion_ids` (and `prompt_ids`): token id lists;
- every other field of the record, under its own name (an `answer`, a test case);
- `trainer_state`: the step (`global_step`) and the run's length (`max_steps`).

It returns one number per completion, or None where it does not apply: that function is
then left out of the completion's total, the weighted sum of the others (a completion
no function applies to has no reward, and an advantage of 0). A config names each
function as `"package.module:function"` (or `"package.module.function"`), or as
`"path/to/file.py:function"` (a file, relative to the working directory), with a
weight. A function's name in the metrics is its own (`__name__`), qualified by its
module or file where two share one (`a_score` and `b_score` for two functions named
`score`).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import logging
import math
import numbers
import os
import sys
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any


class RewardError(ValueError):
  """A reward function raised, or returned other than one number (or None) each."""


@dataclasses.dataclass(frozen=True)
class Reward:
  """One reward function, its weight, and its name in the metrics."""

  spec: str
  fn: Callable[..., Sequence[float | None]]
  weight: float = 1.0
  name: str = ""


def load(specs: Sequence[str], weights: Sequence[float] = (), *,
         where: str = "config.rl.rewards") -> list[Reward]:
  """The functions `specs` name, each with its weight (default 1) and a name no other
  has.

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
  loaded = []
  for spec, weight in zip(specs, weights, strict=True):
    fn = named(spec, where=where, what="reward function")
    module_name, sep, attr = spec.rpartition(":")
    if not sep:
      module_name, _, attr = spec.rpartition(".")
    if not callable(fn):
      raise ValueError(f"{where}: {spec!r} is a {type(fn).__name__}, not a function.")
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(
        weight):
      raise ValueError(f"{where}_weights: {weight!r} for {spec!r} must be a finite number.")
    loaded.append((spec, fn, float(weight), (getattr(fn, "__name__", attr), module_name)))
  names = _unique_names([named for *_, named in loaded])
  return [Reward(spec, fn, weight, name)
          for (spec, fn, weight, _), name in zip(loaded, names, strict=True)]


def named(spec: str, *, where: str, what: str) -> Any:
  """What `spec` names: `"package.module:name"` (or `"package.module.name"`), or
  `"path/to/file.py:name"` (a file, relative to the working directory).

  Raises:
    ValueError: naming `where` and the spec, when it cannot be imported or has no such
      name.
  """
  module_name, sep, attr = spec.rpartition(":")
  if not sep:
    module_name, _, attr = spec.rpartition(".")
  try:
    module = _module(module_name)
  except (ImportError, ValueError, OSError, SyntaxError) as e:
    raise ValueError(f"{where}: cannot import the {what} {spec!r} ({e}); name it as "
                     f"'package.module:name', importable from the run, or "
                     f"'path/to/file.py:name'.") from e
  value = getattr(module, attr, None)
  if value is None:
    listed = ", ".join(_functions(module)) or "it has none"
    raise ValueError(f"{where}: {spec!r}: {_where(module_name)} has no {attr!r}; name one "
                     f"of its functions ({listed}).")
  return value


def _unique_names(named: list[tuple[str, str]]) -> list[str]:
  """Each function's own name, qualified by its module (a file's stem) where two share
  one (`a_score`, `b_score`), and numbered where even that is shared; letters, digits and
  `_` only."""
  own = [n for n, _ in named]
  names = []
  for name, module in named:
    if own.count(name) > 1:
      stem = os.path.splitext(os.path.basename(module))[0] if module.endswith(".py") else module
      name = f"{stem}_{name}"
    names.append("".join(c if c.isalnum() else "_" for c in name))
  for i, name in enumerate(names):
    if names.count(name) > 1:
      names[i] = f"{name}_{names[:i].count(name)}"
  return names


def _where(module_name: str) -> str:
  return f"the file {module_name}" if module_name.endswith(".py") else (
      f"the module {module_name}")


def _functions(module) -> list[str]:
  return sorted(n for n, v in vars(module).items()
                if isinstance(v, types.FunctionType | type) and not n.startswith("_")
                and getattr(v, "__module__", None) == module.__name__)


def _module(name: str):
  """A module by import path, or a `.py` file's (loaded once, under its path)."""
  if not name.endswith(".py"):
    return importlib.import_module(name)
  path = os.path.abspath(name)
  if not os.path.isfile(path):
    raise ImportError(f"no file {path}")
  key = f"_reward_file_{abs(hash(path))}"
  if key not in sys.modules:
    spec = importlib.util.spec_from_file_location(key, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[key] = module
  return sys.modules[key]


def conversational(prompt: Any) -> bool:
  """Whether a prompt is a conversation (a list of turns), as TRL's `is_conversational`."""
  return isinstance(prompt, list) and bool(prompt) and all(
      isinstance(m, Mapping) and "role" in m for m in prompt)


def arguments(records: Sequence[Mapping[str, Any]], completions: Sequence[str], *,
              prompt_field: str, prompt_ids: Sequence[Sequence[int]],
              completion_ids: Sequence[Sequence[int]], step: int = 0,
              max_steps: int | None = None, messages: Sequence[list] | None = None,
              environments: Sequence[Any] | None = None) -> dict[str, Any]:
  """The keyword arguments of a reward call on `completions` of `records` (one record per
  completion, a group's repeated): TRL's, as the module docstring lists them. A
  multi-turn rollout's completions are its `messages` (its assistant turns and tool
  turns), and its `environments` are passed too."""
  prompts = [r[prompt_field] for r in records]
  kwargs: dict[str, Any] = {}
  for key in dict.fromkeys(k for r in records for k in r):
    if key not in (prompt_field, "completion", "completion_ids"):
      kwargs[key] = [r.get(key) for r in records]
  texts = list(completions)
  if messages is not None:
    texts = [list(m) for m in messages]
  elif prompts and conversational(prompts[0]):
    texts = [[{"role": "assistant", "content": c}] for c in completions]
  if environments is not None:
    kwargs["environments"] = list(environments)
  return {**kwargs, "prompts": prompts, "completions": texts,
          "prompt_ids": [list(p) for p in prompt_ids],
          "completion_ids": [list(c) for c in completion_ids],
          "trainer_state": types.SimpleNamespace(global_step=int(step), max_steps=max_steps)}


def score(rewards: Sequence[Reward], kwargs: Mapping[str, Any], *, warn: bool = True
          ) -> tuple[list[float], dict[str, list[float]]]:
  """The weighted total per completion (NaN where every function returned None) and each
  function's values (NaN for None), for one call's `kwargs` (`arguments`).

  Raises:
    RewardError: a function raised (its exception the cause), or returned other than one
      number or None per completion, naming the function, the value and what is accepted.
  """
  n = len(kwargs["completions"])
  values: dict[str, list[float]] = {}
  for reward in rewards:
    try:
      out = reward.fn(**kwargs)
    except Exception as e:
      raise RewardError(f"the reward function {reward.name!r} ({reward.spec}) raised "
                        f"{type(e).__name__}: {e}") from e
    values[reward.name] = _checked(reward, out, n, kwargs["completions"])
  totals = []
  for i in range(n):
    applied = [(r.weight, values[r.name][i]) for r in rewards
               if not math.isnan(values[r.name][i])]
    totals.append(sum(w * v for w, v in applied) if applied else math.nan)
  unscored = [i for i, t in enumerate(totals) if math.isnan(t)]
  if unscored and warn:
    logging.warning("Every reward function returned None for %d of %d completions (the "
                    "first: %r): they get no reward and an advantage of 0.", len(unscored), n,
                    kwargs["completions"][unscored[0]])
  return totals, values


def _checked(reward: Reward, out: Any, n: int, completions: Sequence[Any]) -> list[float]:
  """A function's return as floats (None as NaN), or a `RewardError`."""
  accepted = f"one number (or None: not applicable) per completion, {n} in all"
  if isinstance(out, str | bytes | Mapping) or not hasattr(out, "__iter__"):
    raise RewardError(f"the reward function {reward.name!r} ({reward.spec}) returned "
                      f"{_short(out)}; it must return a list of {accepted}.")
  out = list(out)
  if len(out) != n:
    raise RewardError(f"the reward function {reward.name!r} ({reward.spec}) returned "
                      f"{len(out)} values for {n} completions; it must return {accepted}.")
  floats = []
  for i, value in enumerate(out):
    if value is None:
      floats.append(math.nan)
      continue
    if not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
      raise RewardError(f"the reward function {reward.name!r} ({reward.spec}) returned "
                        f"{_short(value)} for completion {i} ({_short(completions[i])}); it "
                        f"must return {accepted}, each finite.")
    floats.append(float(value))
  return floats


def _short(value: Any, width: int = 80) -> str:
  text = repr(value)
  return text if len(text) <= width else text[:width - 3] + "..."


def check(rewards: Sequence[Reward], records: Sequence[Mapping[str, Any]], *,
          prompt_field: str, prompt_ids: Sequence[Sequence[int]],
          environments: Sequence[Any] | None = None) -> None:
  """Calls every function once on `records` (the first prompts a run reads) with empty
  completions, before the train step compiles, so that a function that cannot be called
  with the records' fields, or returns what cannot be a reward, is refused in seconds.

  Raises:
    RewardError: as `score`.
  """
  if not records:
    return
  score(rewards, arguments(records, [""] * len(records), prompt_field=prompt_field,
                           prompt_ids=prompt_ids, completion_ids=[[] for _ in records],
                           environments=environments),
        warn=False)
