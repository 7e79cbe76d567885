"""Partial restore (`config.init_from`): a new run's variables, some of them from an earlier run.

The source is one of:

- this project's checkpoints: a workdir (holding `checkpoints/`), its
  `checkpoints` directory (the latest step, or `init_from.step`), or one step
  directory; written under any strategy, an ensemble included;
- a plain orbax PyTree checkpoint directory (`ocp.StandardCheckpointer().save`)
  or a Flax msgpack file (`flax.serialization.to_bytes`) of a parameter tree,
  of a Linen variables dict (`{'params': ..., 'batch_stats': ...}`) or of a
  train state with such fields;
- a Hugging Face model directory (`config.json` and safetensors) or a
  `.safetensors` file, of a family `trainer.interop.families` maps (its arrays
  appear under this project's names and layouts, and every one must be used).

Rules map the new model's variable paths to the old one's. A path is the
`/`-joined names inside a collection (`Conv_0/kernel`, as `config.freeze`
writes it) and the same rules apply in every collection: `params`, and each
`model_state` collection (BatchNorm's `batch_stats`), so statistics follow
their layer. `init_from.rules` is a tuple of `(new pattern, old path)` pairs:
the pattern is a regular expression matching the whole new path, the old path
its expansion (`\\1` for groups); empty means every path from the same path.
`init_from.fresh` patterns keep their fresh initialisation even where a rule
matches (a new head). Paths no rule matches stay fresh too.

Refused before any compute, naming the paths and shapes: a rule or fresh
pattern that matches no path, a path that two rules map, an old path that is
not in the source, a shape that differs. One difference is loaded: a new
variable longer than its source only along a dimension annotated `vocab` (the
vocabulary padded to the mesh, `models.vocab`) takes the source's rows and
zeros after them. The optimizer state starts fresh
from the restored parameters (and so does the recipe's state, an EMA of them).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from typing import Any

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from flax import serialization

from strategies.tree import key_name
from trainer.checkpoint.source import Flat, Source, leaf_name
from trainer.checkpoint.store import LAYOUT_ITEM, STATE_ITEM, Checkpointer, CheckpointError

PyTree = Any

IDENTITY = ((".*", r"\g<0>"),)


_name = leaf_name  # A leaf's path, as every rule names it.


def _flatten(tree: PyTree) -> dict[str, Any]:
  """`{path: leaf}` (`_name`)."""
  return {_name(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def flat_weights(tree: PyTree) -> dict[str, Any]:
  """`_flatten` (what a `plan` matches), with each quantized weight (QLoRA's base,
  `trainer.step.quantized_base`) one entry: its path, shape and scale's dtype."""
  from trainer.step.quantized_base import is_quantized

  out = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree, is_leaf=is_quantized):
    if is_quantized(leaf):
      codes, scale = (jax.tree.leaves(x)[0] for x in (leaf.array.qvalue, leaf.array.scale))
      leaf = jax.ShapeDtypeStruct(codes.shape, scale.dtype)
    out[_name(path)] = leaf
  return out


def variables_by_collection(params: PyTree, model_state: PyTree, *,
                            linen: bool) -> Flat:
  """`params` and the model state as collections of flat paths: a Linen model's state is
  keyed by collection (`batch_stats`), an NNX model's is one `model_state` collection."""
  out = {"params": flat_weights(params)}
  if linen:
    for name, tree in dict(model_state or {}).items():
      out[name] = _flatten(tree)
  elif jax.tree.leaves(model_state):
    out["model_state"] = _flatten(model_state)
  return out


def _shapes(tree: PyTree) -> dict[str, tuple[int, ...]]:
  return {p: tuple(x.shape) for p, x in _flatten(tree).items()}


#: Top-level fields of a saved train state that are not model variables.
_NOT_VARIABLES = ("params", "opt_state", "step", "rng", "model_state", "ema_params",
                  "ema_decay")


def _collections(tree: Mapping, *, linen: bool) -> dict[str, tuple[str, ...]]:
  """Where a saved tree keeps each collection: `{collection: keys from the root}`.

  The parameters are under `params` (else the whole tree is the parameters); a
  Linen model's other collections under `model_state` (this project's train
  state) or at the top (a Flax variables dict or a Flax example's train state);
  an NNX model's state under `model_state`.
  """
  if not isinstance(tree, Mapping) or "params" not in tree:
    return {"params": ()}
  out = {"params": ("params",)}
  state = tree.get("model_state")
  if not linen:
    if state is not None and jax.tree.leaves(state):
      out["model_state"] = ("model_state",)
    return out
  if isinstance(state, Mapping):
    return {**out, **{name: ("model_state", name) for name in state}}
  return {**out, **{name: (name,) for name in tree if name not in _NOT_VARIABLES}}


def _at(tree: Any, keys: tuple) -> Any:
  for k in keys:
    tree = tree[k]
  return tree


def _orbax_source(directory: str, description: str, num_members: int, *,
                  linen: bool, held_once: tuple[str, ...] = ()) -> Source:
  """`held_once`: the saved paths an ensemble held once for every member (no member axis;
  seen here with one, as every member's)."""
  handler = ocp.PyTreeCheckpointHandler()
  path = epath.Path(directory)
  try:
    meta = handler.metadata(path)
    tree = getattr(meta, "tree", meta)
  except Exception as e:
    raise CheckpointError(f"config.init_from.path: {description} is not a readable orbax "
                          f"checkpoint ({type(e).__name__}: {e}).") from e
  where = _collections(tree, linen=linen)
  keys = {name: {_name(p): prefix + tuple(key_name(k) for k in p)
                 for p, _ in jax.tree_util.tree_leaves_with_path(_at(tree, prefix))}
          for name, prefix in where.items()}

  def read(wanted: Mapping[str, list[str]]) -> Flat:
    item: dict = {}
    for name, paths in wanted.items():
      for p in paths:
        *parents, last = keys[name][p]
        node = item
        for k in parents:
          node = node.setdefault(k, {})
        node[last] = ocp.RestoreArgs(restore_type=np.ndarray)
    try:
      restored = handler.restore(path, args=ocp.args.PyTreeRestore(
          item=item, restore_args=item, partial_restore=True))
    except Exception as e:
      raise CheckpointError(f"config.init_from.path: reading {description} failed "
                            f"({type(e).__name__}: {e}).") from e
    return {name: {p: once(name, p, np.asarray(_at(restored, keys[name][p])))
                   for p in paths} for name, paths in wanted.items()}

  held = set(held_once)

  def members(name, p) -> tuple[int, ...]:  # A part every member read: one copy, no axis.
    return (num_members,) if "/".join(keys[name][p]).removesuffix("/value") in held else ()

  def once(name, p, x):  # That copy as each member's.
    return np.broadcast_to(x, members(name, p) + np.shape(x)) if members(name, p) else x

  return Source(description, num_members,
                {name: {p: members(name, p) + shape
                        for p, shape in _shapes(_at(tree, prefix)).items()}
                 for name, prefix in where.items()}, read)


def _msgpack_source(path: str, *, linen: bool) -> Source:
  try:
    with open(path, "rb") as f:
      tree = serialization.msgpack_restore(f.read())
  except Exception as e:
    raise CheckpointError(f"config.init_from.path={path!r} is neither a checkpoint directory "
                          f"nor a readable Flax msgpack file ({type(e).__name__}: {e}).") from e
  collections = {name: _flatten(jax.tree.map(np.asarray, _at(tree, prefix)))
                 for name, prefix in _collections(tree, linen=linen).items()}

  def read(wanted):
    return {name: {p: collections[name][p] for p in paths} for name, paths in wanted.items()}

  return Source(f"Flax msgpack file {path}", 0,
                {name: {p: np.shape(x) for p, x in sub.items()}
                 for name, sub in collections.items()}, read)


def open_source(path: str, *, step: int = -1, linen: bool = True) -> Source:
  """The `Source` at `path` (see the module docstring for what it may be).

  Raises:
    ValueError: `path` does not exist, or names a step the checkpoints lack.
    CheckpointError: it cannot be read.
  """
  from trainer.interop import hf

  path = os.path.abspath(os.path.expanduser(path))
  if not os.path.exists(path):
    raise ValueError(f"config.init_from.path={path!r} does not exist; it must be a workdir, "
                     f"a checkpoints directory, a checkpoint step directory, an orbax PyTree "
                     f"checkpoint directory, a Flax msgpack file, or a Hugging Face model "
                     f"directory or .safetensors file.")
  if hf.is_hf_checkpoint(path):
    return hf.open_source(path)
  if os.path.isfile(path):
    return _msgpack_source(path, linen=linen)
  if os.path.isdir(os.path.join(path, "checkpoints")):
    path = os.path.join(path, "checkpoints")
  if all(os.path.isdir(os.path.join(path, item)) for item in (STATE_ITEM, LAYOUT_ITEM)):
    root, step = os.path.dirname(path), int(os.path.basename(path))
  else:
    root = path
  checkpointer = Checkpointer(root, every_steps=0, async_save=False)
  steps = checkpointer.all_steps()
  if not steps:  # Not this project's layout: a plain orbax tree.
    return _orbax_source(path, f"orbax checkpoint {path}", 0, linen=linen)
  if step is None or step < 0:
    step = steps[-1]
  elif step not in steps:
    raise ValueError(f"config.init_from.step={step} is not a checkpoint in {root}; its "
                     f"complete checkpoints are steps {steps}.")
  layout = checkpointer.layout(step)
  return _orbax_source(os.path.join(checkpointer.step_dir(step), STATE_ITEM),
                       f"checkpoint step {step} in {root} (written by {layout.get('strategy')!r})",
                       int(layout["num_members"]), linen=linen,
                       held_once=tuple(layout.get("held_once", ())))


@dataclasses.dataclass
class Plan:
  """Which new variables come from which old ones.

  Attributes:
    source: where they come from.
    mapped: `{collection: {new path: old path}}`.
    fresh: `{collection: [new paths]}` that keep their initialisation.
    member: the source member every new model takes, or None (a single-model
      source; or member i into member i of an ensemble of the same size).
  """

  source: Source
  mapped: dict[str, dict[str, str]]
  fresh: dict[str, list[str]]
  member: int | None
  #: `{collection: {new path: (axis, source rows, new rows)}}`: variables whose padded
  #: vocabulary axis is longer than the source's (the rows after the source's are zeros).
  padded: dict[str, dict[str, tuple[int, int, int]]] = dataclasses.field(default_factory=dict)

  def describe(self) -> str:
    loaded = sum(len(m) for m in self.mapped.values())
    fresh = [f"{c}/{p}" if c != "params" else p for c, ps in self.fresh.items() for p in ps]
    which = "" if self.member is None else f", member {self.member}"
    padded = [f"{p} ({rows} -> {new} vocabulary rows)" for ps in self.padded.values()
              for p, (_, rows, new) in ps.items()]
    return (f"{loaded} arrays from {self.source.description}{which}; fresh: "
            f"{fresh if fresh else 'none'}" + (f"; zero rows after {padded}" if padded else ""))


def vocab_axes(params: PyTree) -> dict[str, dict[str, int]]:
  """`{'params': {path: dimension}}` of the parameters (one model's, abstract, with their
  annotations) that have a dimension annotated `vocab`."""
  from strategies.layout import annotations, axis_names

  out = {}
  for path, _, _, names, _ in annotations(params):
    dims = [d for d, entry in enumerate(names) if "vocab" in axis_names(entry)]
    if dims:
      out[path] = dims[0]
  return {"params": out}


def plan(config: ml_collections.ConfigDict, source: Source, new: Flat, *,
         num_members: int, vocab: Mapping[str, Mapping[str, int]] | None = None) -> Plan:
  """Matches the new model's variables (`{collection: {path: ShapeDtypeStruct}}`, one
  model) to `source` by `config.init_from`'s rules.

  Args:
    num_members: the new strategy's ensemble size (0: one model).
    vocab: `{collection: {path: dimension}}` of the new variables' vocabulary dimensions
      (`vocab_axes`): one that is longer than its source's, and no other, is zero-padded.

  Raises:
    ValueError: a rule or fresh pattern that matches nothing, a path two rules map, an old
      path the source lacks, a shape that differs, or members that do not correspond.
  """
  spec = config.init_from
  rules = [tuple(r) for r in spec.rules] or list(IDENTITY)
  for i, rule in enumerate(rules):
    if len(rule) != 2 or not all(isinstance(x, str) for x in rule):
      raise ValueError(f"config.init_from.rules[{i}]={rule!r} must be a (new path pattern, "
                       f"old path) pair of strings, e.g. ('encoder/(.*)', r'backbone/\\1').")
  member = _member(spec.member, source, num_members)
  saved_members = source.num_members if member is not None or num_members else 0
  from trainer.step import lora
  fresh_patterns = list(spec.fresh) + ([lora.ADAPTERS] if config.lora.rank
                                       and not spec.adapters else [])
  fresh_used = {p: False for p in fresh_patterns}
  rule_used = [False] * len(rules)
  mapped: dict[str, dict[str, str]] = {}
  fresh: dict[str, list[str]] = {}
  mismatched: list[str] = []
  padded: dict[str, dict[str, tuple[int, int, int]]] = {}
  for c, paths in new.items():
    old = source.arrays.get(c, {})
    for path, want in paths.items():
      keep = [p for p in fresh_patterns if re.fullmatch(p, path)]
      for p in keep:
        fresh_used[p] = True
      hits = [(i, m) for i, (pattern, _) in enumerate(rules)
              if (m := re.fullmatch(pattern, path))]
      for i, _ in hits:
        rule_used[i] = True
      if keep or not hits:
        fresh.setdefault(c, []).append(path)
        continue
      if len(hits) > 1:
        raise ValueError(
            f"config.init_from: {c} path {path!r} is mapped twice, by rules "
            f"{[rules[i] for i, _ in hits]}; make the patterns disjoint.")
      i, m = hits[0]
      old_path = m.expand(rules[i][1])
      if old_path not in old:
        near = sorted(old, key=lambda p: (p.split("/")[-1] != path.split("/")[-1], p))[:8]
        raise ValueError(
            f"config.init_from.rules[{i}]={rules[i]!r} maps {c} path {path!r} (shape "
            f"{tuple(want.shape)}) to {old_path!r}, which {source.description} does not "
            f"hold; its {c} paths include {near}. Map it to one of them, or leave it fresh "
            f"with config.init_from.fresh.")
      have = source.arrays[c][old_path]
      have = have[1:] if saved_members else have
      axis = (vocab or {}).get(c, {}).get(path)
      if (axis is not None and len(have) == len(want.shape) and have[axis] < want.shape[axis]
          and all(h == w for d, (h, w) in enumerate(zip(have, want.shape, strict=True))
                  if d != axis)):
        padded.setdefault(c, {})[path] = (axis, have[axis], want.shape[axis])
      elif tuple(have) != tuple(want.shape):
        mismatched.append(f"{c} path {path!r} has shape {tuple(want.shape)} in the new model "
                          f"but {old_path!r} has shape {tuple(have)} in {source.description}")
      mapped.setdefault(c, {})[path] = old_path
  if mismatched:
    raise ValueError(
        f"config.init_from: {len(mismatched)} variable(s) of the new model differ in shape "
        f"from the ones the rules map them to; map other paths, or leave them fresh with "
        f"config.init_from.fresh:\n  " + "\n  ".join(mismatched))
  all_paths = sorted(f"{c}:{p}" if c != "params" else p for c, ps in new.items() for p in ps)
  for i, used in enumerate(rule_used):
    if not used:
      raise ValueError(f"config.init_from.rules[{i}]={rules[i]!r} matches no variable of the "
                       f"new model; its paths are {all_paths}.")
  for p, used in fresh_used.items():
    if not used:
      raise ValueError(f"config.init_from.fresh pattern {p!r} matches no variable of the new "
                       f"model; its paths are {all_paths}.")
  if source.complete:
    unused = sorted(f"{c}/{p}" if c != "params" else p for c, paths in source.arrays.items()
                    for p in set(paths) - set(mapped.get(c, {}).values()))
    if unused:
      raise ValueError(
          f"config.init_from: {len(unused)} array(s) of {source.description} go to no "
          f"variable of the new model: {unused[:12]}; the new model's paths are "
          f"{all_paths[:24]}. Is config.model the checkpoint's architecture "
          f"(trainer.interop.hf.model_fields)?")
  return Plan(source, mapped, fresh, member, padded)


def _member(member: int, source: Source, num_members: int) -> int | None:
  """Which source member every new model takes (None: all of a one-model source, or each its
  own); refuses layouts that do not correspond."""
  saved = source.num_members
  if member is not None and member >= 0:
    if not saved:
      raise ValueError(f"config.init_from.member={member} but {source.description} holds a "
                       f"single model; leave config.init_from.member at -1.")
    if member >= saved:
      raise ValueError(f"config.init_from.member={member} is out of range: "
                       f"{source.description} holds {saved} members (0 to {saved - 1}).")
    return member
  if saved and saved != num_members:
    raise ValueError(
        f"{source.description} holds an ensemble of {saved} members and the new run holds "
        f"{f'{num_members} members' if num_members else 'one model'}; set "
        f"config.init_from.member to the member to start from (0 to {saved - 1}).")
  return None


def __getattr__(name: str) -> Any:
  if name in ("placed", "start_from"):  # Moved: named, not imported (no import cycle).
    raise AttributeError(f"trainer.checkpoint.init_from.{name} is now "
                         f"trainer.checkpoint.loading.{name}")
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
