"""Frozen parts of an ensemble held once: which state leaves every member reads from one copy.

A sweep or an ensemble under `sharded_ensemble` stacks each member's state on a leading
member axis. A frozen part whose values are the same in every member by construction is
held once instead (no member axis, placed as a single data-parallel run places it), and
every member's step reads that copy (`strategies.sharded_ensemble`). The parts:

- `base`: the parameters the optimizer freezes (LoRA's and QLoRA's base, `config.freeze`)
  that `config.init_from` loads;
- `reference`: a `copy` reference's weights (preference, RL) that copy parameters
  `config.init_from` loads;
- `teacher`: a distillation teacher (read from its own source, the same for every member).

They are told apart by where the values come from, never by comparing arrays: a parameter
is the same in every member where `config.init_from` loads it from one model, or where
nothing loads it and every member starts from one seed (a sweep with one seed). A parameter
that starts from each member's own seed (an ensemble, a sweep over seeds), and one loaded
from a saved ensemble of the same size (each member its own), stay per member, as do every
trained parameter, the optimizer state and an EMA. A sweep varies only what the program
takes as data (`trainer.sweep.members`), so a shared part stays the same in every member.

`config.strategy.share_frozen`: `"auto"` (every part above, where identical), `"none"`
(each member holds its own copy), or a comma-separated list of part names, each of which
must be identical in every member (else refused before compute).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from typing import Any

import ml_collections

PARTS = ("base", "reference", "teacher")
CHOICES = ("auto", "none")
#: The train state's fields that hold a frozen part other than the base.
FIELDS = {"reference": "reference", "teacher": "teacher"}


def requested(config: ml_collections.ConfigDict) -> tuple[tuple[str, ...], bool]:
  """The parts `config.strategy.share_frozen` asks for, and whether it named them.

  Raises:
    ValueError: naming the field, the value and what is accepted; or a strategy that holds
      one member per device (`pmap_ensemble`) asked to share by name.
  """
  value = config.strategy.share_frozen
  accepted = f"{CHOICES[0]!r}, {CHOICES[1]!r} or a comma-separated list of {PARTS}"
  if not isinstance(value, str):
    raise ValueError(f"config.strategy.share_frozen={value!r} must be {accepted}.")
  if value in CHOICES:
    return (PARTS if value == "auto" else ()), False
  parts = tuple(p.strip() for p in value.split(","))
  unknown = [p for p in parts if p not in PARTS]
  if unknown or not parts:
    raise ValueError(f"config.strategy.share_frozen={value!r} names {unknown or parts}; it "
                     f"must be {accepted}.")
  if config.strategy.name == "pmap_ensemble":
    raise ValueError(
        f"config.strategy.share_frozen={value!r} with config.strategy.name='pmap_ensemble': "
        f"a pmap ensemble holds one member per device, so each device holds its member's "
        f"frozen parts once already and cannot share them between devices; use "
        f"'sharded_ensemble' to hold several members per device over one copy, or leave "
        f"share_frozen at 'auto'.")
  return parts, True


@dataclasses.dataclass(frozen=True)
class Sharing:
  """Which leaves of one member's state are held once.

  Attributes:
    parts: the parts shared.
    frozen: the path patterns of the parameters the optimizer freezes.
    loaded: the parameter paths `config.init_from` loads (from `source`).
    same_source: whether each loaded parameter is the same in every member (loaded from
      one model, not from each member of a saved ensemble).
    same_seed: whether every member starts from one seed (a sweep with one seed), so the
      parameters nothing loads start the same.
  """

  parts: tuple[str, ...]
  frozen: tuple[str, ...]
  loaded: frozenset[str]
  same_source: bool
  same_seed: bool

  def __call__(self, path: str) -> bool:
    """Whether the state leaf at `path` (`/`-joined, `params/blocks/attn/kernel/qvalue`)
    is held once."""
    field, _, rest = path.partition("/")
    if field == "params" and "base" in self.parts:
      name = self._same(rest)
      return name is not None and any(re.fullmatch(p, name) for p in self.frozen)
    if field == FIELDS["reference"] and "reference" in self.parts:
      return self._same(rest) is not None
    return field == FIELDS["teacher"] and "teacher" in self.parts

  def _same(self, rest: str) -> str | None:
    """The parameter `rest` is (or is part of: a quantized weight's codes), where it
    starts the same in every member; else None."""
    parts = rest.split("/")
    for i in range(len(parts), 0, -1):
      name = "/".join(parts[:i])
      if name in self.loaded:
        return name if self.same_source else None
    return rest if self.same_seed else None


def sharing(config: ml_collections.ConfigDict, abstract_state: Any,
            plan: Any) -> Sharing | None:
  """The `Sharing` of an ensemble whose one-member state is `abstract_state` and whose
  `config.init_from` plan is `plan` (None: off); None where no part is held once.

  Raises:
    ValueError: a part named in `config.strategy.share_frozen` that is absent or not the
      same in every member, naming the field and why.
  """
  parts, named = requested(config)
  if not parts:
    return None
  from strategies.capabilities import sweep_seeds
  from trainer.step.optim import frozen_patterns
  seeds = sweep_seeds(config)
  made = Sharing(parts, frozen_patterns(config),
                 frozenset(plan.mapped.get("params", {})) if plan is not None else frozenset(),
                 same_source=plan is not None and (plan.member is not None
                                                   or not plan.source.num_members),
                 same_seed=seeds is not None and len(set(seeds)) == 1)
  why = _why_not(made, abstract_state, plan)
  if named:
    for part in parts:
      if why[part]:
        raise ValueError(f"config.strategy.share_frozen={config.strategy.share_frozen!r} "
                         f"names {part!r}, which cannot be held once: {why[part]}.")
  parts = tuple(p for p in parts if not why[p])
  return dataclasses.replace(made, parts=parts) if parts else None


def _why_not(made: Sharing, abstract_state: Any, plan: Any) -> Mapping[str, str]:
  """Each part's reason it is not the same in every member ("" where it is)."""
  import jax

  from strategies.tree import keypath_str
  params = [keypath_str(p, drop_box=True)
            for p, _ in jax.tree_util.tree_leaves_with_path(abstract_state.params)]
  if plan is not None and not made.same_source:
    source = (f"config.init_from.path holds an ensemble of {plan.source.num_members} "
              f"members and each member starts from its own (set config.init_from.member "
              f"to start all from one)")
  else:
    source = ("what config.init_from does not load starts from each member's own seed (a "
              "sweep with one seed, or config.init_from.path, starts all alike)")
  frozen = [p for p in params if any(re.fullmatch(f, p) for f in made.frozen)]
  base = ("no parameter is frozen (config.lora.rank=0 and config.freeze=())" if not frozen
          else "" if any(made._same(p) for p in frozen) else source)
  reference = ("the state holds no reference copy (a 'copy' reference of a preference or "
               "RL run)" if getattr(abstract_state, "reference", None) is None
               else "" if any(made._same(p) for p in params) else source)
  teacher = ("the state holds no teacher (a distillation run)"
             if getattr(abstract_state, "teacher", None) is None else "")
  return {"base": base, "reference": reference, "teacher": teacher}


def held_once(strategy: Any, field: str) -> Callable[[str], bool]:
  """`name -> whether the state field `field`'s variable `name` is held once` under
  `strategy` (False for every name where nothing is)."""
  shared = getattr(strategy, "shared", None)
  return (lambda name: shared(f"{field}/{name}")) if shared else (lambda name: False)


def per_member(strategy: Any, rebuild: Callable[..., Any], abstract_state: Any
               ) -> Callable[..., Any]:
  """`rebuild(params, model_state, rng) -> one member's state` over an ensemble's stacked
  variables (`jax.vmap`), the leaves held once read and returned as their one copy."""
  import jax
  if getattr(strategy, "shared", None) is None:
    return jax.vmap(rebuild)
  mask = strategy.member_mask(abstract_state)
  axes = jax.tree.map(lambda m: 0 if m else None, (mask.params, mask.model_state, mask.rng))
  return lambda *v: jax.tree.map(lambda m, x: x if m else x[0], mask,
                                 jax.vmap(rebuild, in_axes=axes)(*v))
