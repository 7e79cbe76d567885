"""Which parameters a LoRA or QLoRA config picks (`trainer.step.lora`,
`trainer.step.quantized_base`): path patterns checked and matched, the modules holding
the matched weights, adapters' names and shapes, and nested parameter dicts walked."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

#: The suffixes Qwix gives a weight's adapters.
SUFFIX_A, SUFFIX_B = "_lora_a", "_lora_b"


def check_patterns(field: str, patterns: tuple, example: tuple[str, ...]) -> None:
  """Raises unless `patterns` (the value of config `field`) are regular expressions."""
  if not patterns or not all(isinstance(p, str) for p in patterns):
    raise ValueError(f"{field}={patterns!r} must be regular expressions on parameter paths, "
                     f"e.g. ({', '.join(example)}).")
  for p in patterns:
    try:
      re.compile(p)
    except re.error as e:
      raise ValueError(f"{field} entry {p!r} is not a regular expression ({e}).") from e


def matched_paths(field: str, patterns: tuple[str, ...], paths: list[str]) -> list[str]:
  """The `paths` the `patterns` of config `field` match.

  Raises:
    ValueError: a pattern that matches no path (naming the paths).
  """
  out = set()
  for p in patterns:
    hits = [q for q in paths if re.fullmatch(p, q)]
    if not hits:
      raise ValueError(f"{field} entry {p!r} matches no parameter; the parameters are "
                       f"{sorted(paths)}.")
    out.update(hits)
  return sorted(out)


def _modules(paths: list[str]) -> set[str]:
  """The module paths holding parameters at `paths`."""
  return {p.rsplit("/", 1)[0] if "/" in p else "" for p in paths}


def _any_of(modules: set[str]) -> str:
  """A Qwix `module_path` regex matching exactly `modules`."""
  return "|".join(re.escape(m) for m in sorted(modules))


def _leading_axes(w: np.ndarray, a: np.ndarray, b: np.ndarray, rank: int) -> int:
  """How many leading axes (stacked layers) the weight and its adapters share: A is
  `[*lead, inputs..., rank]`, B `[*lead, rank, outputs...]`."""
  for lead in range(min(a.ndim, b.ndim)):
    n = int(np.prod(b.shape[:lead]))
    if (a.shape[:lead] == b.shape[:lead] == w.shape[:lead] and a.shape[-1] == rank
        and b.shape[lead] == rank and (a.size // rank) * (b.size // rank) == w.size * n):
      return lead
  raise ValueError(f"adapters {a.shape} and {b.shape} of rank {rank} do not fit the weight "
                   f"{w.shape}")


def _at(tree: dict, path: str) -> tuple[dict, str]:
  *parents, leaf = path.split("/")
  for key in parents:
    tree = tree[key]
  return tree, leaf


def matched_weights(params: dict, weights: Mapping[str, tuple[int, int]], matched: Any,
                    refusal: str) -> tuple[dict, list[str]]:
  """A copy of `params`' dicts (boxed where annotated; the caller's stay) and the paths of
  its leaves that `matched(paths)` picks, each one of the products' `weights`.

  Raises:
    ValueError: `refusal` formatted with the picked paths that are not weights.
  """
  import flax.linen as nn

  from strategies.tree import keypath_str

  def boxes(x):
    return isinstance(x, nn.meta.AxisMetadata)

  paths = [keypath_str(p, drop_box=True)
           for p, _ in jax.tree_util.tree_leaves_with_path(params, is_leaf=boxes)]
  picked = matched(paths)
  missing = [p for p in picked if p not in weights]
  if missing:
    raise ValueError(refusal.format(missing))
  return jax.tree.map(lambda x: x, params, is_leaf=boxes), picked
