"""Rematerialisation (`config.remat`): recompute activations in the backward pass, by policy.

`config.remat.policy` names a policy of `jax.checkpoint_policies` (what the
forward pass may keep for the backward pass: `nothing_saveable` keeps
nothing, `dots_saveable` keeps matrix products, ...). `config.remat.modules`
names module classes (Linen or NNX, by class name, e.g. `DecoderBlock`): each
call of such a module in a training step is checkpointed on its own, which is
what makes a model of repeated blocks keep one block's activations at a time
(inside `nn.scan` too). With no modules the whole forward pass is checkpointed.
Eval and predict never are: nothing is differentiated there.

No model code changes: a Linen model's calls are intercepted
(`nn.intercept_methods`) and lifted with `nn.checkpoint`; an NNX model's
matching modules are given a subclass whose `__call__` goes through
`nnx.remat`. Parameters and results are the same as without remat, to
round-off (`tests/test_remat.py`); what changes is XLA's temporary memory
and the step time (`benchmarks/remat.py`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import flax.linen as nn
import jax
import ml_collections
import numpy as np
from flax import nnx

#: The policies by name: the members of `jax.checkpoint_policies` that take no arguments.
POLICIES = ("nothing_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable",
            "everything_saveable", "checkpoint_dots", "checkpoint_dots_with_no_batch_dims")


def _split_arrays(args: tuple, kwargs: dict) -> tuple[list, Callable[[list], tuple]]:
  """The array leaves of a call's arguments, and `arrays -> (args, kwargs)`: the other
  leaves (flags such as `train`) stay Python values, as `jax.checkpoint` needs."""
  leaves, treedef = jax.tree.flatten((args, kwargs))
  is_array = [isinstance(x, (jax.Array, np.ndarray)) for x in leaves]

  def rebuild(arrays):
    it = iter(arrays)
    return jax.tree.unflatten(treedef, [next(it) if a else x
                                        for x, a in zip(leaves, is_array, strict=True)])

  return [x for x, a in zip(leaves, is_array, strict=True) if a], rebuild


#: The module systems' own base classes, which name no block.
_BASES = frozenset(nn.Module.__mro__) | frozenset(nnx.Module.__mro__)


def class_names(module: Any) -> list[str]:
  """A module's class name and its bases' (a subclass of a named block matches it)."""
  return [c.__name__ for c in type(module).__mro__ if c not in _BASES]


@dataclasses.dataclass(frozen=True)
class Remat:
  """Which calls are checkpointed, with which policy.

  Attributes:
    policy: a name in `POLICIES`.
    modules: module class names checkpointed per call; empty: the whole forward pass.
  """

  policy: str
  modules: tuple[str, ...] = ()

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict) -> Remat | None:
    """`config.remat`, checked; None when `remat.policy` is empty (off).

    Raises:
      ValueError: an unknown policy, or modules without a policy.
    """
    policy, modules = config.remat.policy, tuple(config.remat.modules)
    if not policy:
      if modules:
        raise ValueError(f"config.remat.modules={modules!r} needs config.remat.policy, one "
                         f"of {POLICIES}.")
      return None
    if policy not in POLICIES or not hasattr(jax.checkpoint_policies, policy):
      raise ValueError(f"config.remat.policy={policy!r} is not one of {POLICIES} (the "
                       f"jax.checkpoint_policies that take no arguments), or '' for none.")
    if not all(isinstance(m, str) and m for m in modules):
      raise ValueError(f"config.remat.modules={modules!r} must be module class names, e.g. "
                       f"('DecoderBlock',).")
    return cls(policy, modules)

  @property
  def policy_fn(self) -> Callable[..., bool]:
    return getattr(jax.checkpoint_policies, self.policy)

  def matches(self, module: Any) -> bool:
    return any(name in self.modules for name in class_names(module))

  def check_found(self, present: Iterable[str]) -> None:
    """Raises ValueError for a module class in `modules` the model does not have."""
    present = set(present)
    missing = [m for m in self.modules if m not in present]
    if missing:
      raise ValueError(f"config.remat.modules names {missing}, but the model has no module "
                       f"of that class; its module classes are {sorted(present)}.")

  # -- The whole forward pass ------------------------------------------------------------

  def call(self, fn: Callable[..., Any], *args, **kwargs) -> Any:
    """`fn(*args, **kwargs)` checkpointed as one piece (`jax.checkpoint`)."""
    arrays, rebuild = _split_arrays(args, kwargs)

    def run(arrays):
      a, k = rebuild(arrays)
      return fn(*a, **k)

    return jax.checkpoint(run, policy=self.policy_fn)(arrays)

  # -- Per module: Linen ---------------------------------------------------------------

  def linen_interceptor(self) -> Callable:
    """An `nn.intercept_methods` interceptor checkpointing each matching module's call."""

    def intercept(next_fun, args, kwargs, context):
      module = context.module
      if (context.method_name != "__call__" or not self.matches(module)
          or getattr(module, "_remat_inner", False)):
        return next_fun(*args, **kwargs)
      arrays, rebuild = _split_arrays(args, kwargs)

      def inner(lifted, arrays):
        object.__setattr__(lifted, "_remat_inner", True)  # Its call is the plain one.
        a, k = rebuild(arrays)
        return lifted(*a, **k)

      return nn.checkpoint(inner, policy=self.policy_fn)(module, arrays)

    return intercept

  def nnx_call(self, model: nnx.Module, *args, **kwargs) -> Any:
    """`model(*args, **kwargs)` checkpointed as one piece (`nnx.remat`, which carries the
    module's state updates, such as BatchNorm's, out of the checkpointed call)."""
    arrays, rebuild = _split_arrays(args, kwargs)

    def run(module, arrays):
      a, k = rebuild(arrays)
      return module(*a, **k)

    return nnx.remat(run, policy=self.policy_fn)(model, arrays)

  # -- Per module: NNX -----------------------------------------------------------------

  def nnx_apply(self, model: nnx.Module) -> None:
    """Gives each matching module of `model` a subclass whose calls go through `nnx.remat`."""
    for _, module in nnx.iter_modules(model):
      if self.matches(module) and not getattr(type(module), "_remat_policy", None):
        module.__class__ = _nnx_remat_class(type(module), self.policy)


_NNX_CLASSES: dict[tuple[type, str], type] = {}


def _nnx_remat_class(cls: type, policy: str) -> type:
  """`cls` with `__call__` under `nnx.remat(policy)`, made once per class and policy."""
  key = (cls, policy)
  if key not in _NNX_CLASSES:
    plain = cls.__call__
    policy_fn = getattr(jax.checkpoint_policies, policy)

    def __call__(self, *args, **kwargs):
      arrays, rebuild = _split_arrays(args, kwargs)

      def inner(module, arrays):
        a, k = rebuild(arrays)
        return plain(module, *a, **k)

      return nnx.remat(inner, policy=policy_fn)(self, arrays)

    _NNX_CLASSES[key] = type(cls.__name__, (cls,), {
        "__call__": __call__, "__module__": cls.__module__, "__qualname__": cls.__qualname__,
        "_remat_policy": policy})
  return _NNX_CLASSES[key]
