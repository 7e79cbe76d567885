"""What a strategy did with a state: mesh, per-parameter layout, bytes per device."""

from __future__ import annotations

import collections
from typing import Any

import jax

from strategies.base import Strategy
from strategies.tree import array_bytes, keypath_str

PyTree = Any


def bytes_per_device(tree: PyTree) -> dict[jax.Device, int]:
  """Bytes each device holds of `tree`'s arrays, summed over their addressable shards."""
  held: dict[jax.Device, int] = collections.defaultdict(int)
  for x in jax.tree.leaves(tree):
    if isinstance(x, jax.Array):
      for shard in x.addressable_shards:
        held[shard.device] += array_bytes(shard.data.shape, x.dtype)
  return dict(held)


def total_bytes(tree: PyTree) -> int:
  """Bytes of `tree`'s arrays as global (logical) arrays."""
  return sum(array_bytes(x.shape, x.dtype) for x in jax.tree.leaves(tree) if hasattr(x, "nbytes"))


def _human(n: float) -> str:
  for unit in ("B", "KiB", "MiB", "GiB"):
    if n < 1024 or unit == "GiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
    n /= 1024
  return f"{n:.1f} GiB"


def _spec(x: jax.Array) -> str:
  spec = getattr(x.sharding, "spec", None)
  return str(spec) if spec is not None else type(x.sharding).__name__


def summarize(strategy: Strategy, state: PyTree) -> str:
  """A table of the state's layout under `strategy`.

  Lists every parameter (path, global shape, partition spec, bytes on the
  fullest device), then, for parameters, optimizer state and model state (if
  any), the bytes of one copy of the model (all members for an ensemble)
  against the most any one device holds.
  """
  lines = [strategy.describe()]
  rows = []
  for path, x in jax.tree_util.tree_leaves_with_path(state.params):
    per_device = max((array_bytes(s.data.shape, x.dtype) for s in x.addressable_shards),
                     default=0)
    rows.append((keypath_str(path, drop_box=True), str(tuple(x.shape)), _spec(x),
                 _human(per_device)))
  widths = [max(len(r[i]) for r in rows + [("parameter", "shape", "spec", "per device")])
            for i in range(4)]
  header = ("parameter", "shape", "spec", "per device")
  for row in [header, *rows]:
    lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))
  canonical = strategy.checkpoint_state(state)
  names = ("params", "opt_state") + (("model_state",) if jax.tree.leaves(
      getattr(state, "model_state", None)) else ())
  for name in names:
    model = total_bytes(getattr(canonical, name))
    fullest = max(bytes_per_device(getattr(state, name)).values(), default=0)
    share = f" (1/{model / fullest:.1f} of the model)" if fullest and model else ""
    lines.append(f"  {name}: {_human(model)} for the model, at most {_human(fullest)} on one "
                 f"device{share}")
  return "\n".join(lines)
