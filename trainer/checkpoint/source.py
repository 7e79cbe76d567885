"""What `config.init_from.path` holds, opened: array metadata and how to read the arrays.

Its own module so that the readers of other formats (`trainer.interop.hf`) make one
without importing `trainer.checkpoint.init_from`, which opens them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

#: The variables of one model as `{collection: {path: array or ShapeDtypeStruct}}`.
Flat = dict[str, dict[str, Any]]


def leaf_name(path: tuple) -> str:
  """A leaf's `/`-joined path (`keypath_str`); Flax's logical-axis box field is left out
  also where saving made it a dict key (`.../value`), so boxed and plain trees name a
  parameter alike."""
  from strategies.tree import keypath_str
  return keypath_str(path).removesuffix("/value")


@dataclasses.dataclass
class Source:
  """What `init_from.path` holds: array metadata per collection, and how to read them.

  Attributes:
    description: the source, for messages.
    num_members: the ensemble size of a checkpoint written by an ensemble (a
      leading member axis on every array), 0 for one model.
    arrays: `{collection: {path: shape}}` of the arrays (member axis included).
    read: `{collection: [paths]} -> {collection: {path: np.ndarray}}`.
    read_slice: `(collection, path, index) -> array[index]`, reading only that slice
      (None: `read` the whole array, then index it).
    complete: every array must go to a variable of the new model (an HF checkpoint: a
      tensor left over means the mapping or the model is wrong).
    handle: what the source keeps open (HF: its `SafetensorsFiles`), or None.
  """

  description: str
  num_members: int
  arrays: dict[str, dict[str, tuple[int, ...]]]
  read: Callable[[Mapping[str, list[str]]], Flat]
  read_slice: Callable[[str, str, Any], np.ndarray] | None = None
  complete: bool = False
  handle: Any = None
