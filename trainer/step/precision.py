"""Mixed precision: compute in bfloat16 or float16, keep parameters and optimizer state in float32.

The policy is the one `jmp` and the Flax/T5X recipes use: parameters and
floating inputs are cast to the compute dtype for the forward and backward
pass, outputs are cast back to float32 before the loss, and gradients arrive
in float32 (the transpose of the cast) for a float32 optimizer update. The
model's state (BatchNorm statistics) stays float32. Set by
`config.mixed_precision.{compute_dtype, loss_scale}`; the recipe's
`MixedPrecision` transform applies it where the forward pass and the loss
are built.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

PyTree = Any

COMPUTE_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class Precision:
  """Which dtype a step computes in, and the static loss scale (float16 only needs one)."""

  compute_dtype: jnp.dtype = jnp.float32
  loss_scale: float = 1.0

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict) -> Precision:
    """Reads `config.mixed_precision`.

    Raises:
      ValueError: an unknown compute dtype or a non-positive loss scale.
    """
    name = config.mixed_precision.compute_dtype
    if name not in COMPUTE_DTYPES:
      raise ValueError(f"config.mixed_precision.compute_dtype={name!r} is not one of "
                       f"{COMPUTE_DTYPES}.")
    scale = config.mixed_precision.loss_scale or (2.0 ** 12 if name == "float16" else 1.0)
    if scale <= 0:
      raise ValueError(f"config.mixed_precision.loss_scale={scale!r} must be positive "
                       f"(0: 2**12 for float16, 1 otherwise).")
    return cls(jnp.dtype(name), float(scale))

  @property
  def is_mixed(self) -> bool:
    return self.compute_dtype != jnp.float32

  def _cast(self, tree: PyTree, dtype) -> PyTree:
    def cast(x):
      if isinstance(x, (jax.Array, jnp.ndarray)) and jnp.issubdtype(x.dtype, jnp.floating):
        return x.astype(dtype)
      return x

    return jax.tree.map(cast, tree)

  def to_compute(self, tree: PyTree) -> PyTree:
    """Floating arrays of `tree` (params, inputs) in the compute dtype; others unchanged."""
    return self._cast(tree, self.compute_dtype) if self.is_mixed else tree

  def to_float32(self, tree: PyTree) -> PyTree:
    """Floating arrays of `tree` (outputs) back in float32, for losses and metrics."""
    return self._cast(tree, jnp.float32) if self.is_mixed else tree


def embeddings_follow_their_tables(model: nnx.Module) -> None:
  """Each `nnx.Embed` of `model` built with NNX's default dtype computes in its table's
  dtype as the step gives it, as Linen's `nn.Embed` does.

  NNX fixes that default when the layer is built (`dtype or` its table's dtype then,
  float32), so under a bfloat16 or float16 step (`config.mixed_precision.compute_dtype`)
  the layer would cast its table back to float32, and every layer after it would compute
  in float32. An Embed built with a dtype other than its `param_dtype` keeps it.
  """
  for _, module in nnx.iter_modules(model):
    if isinstance(module, nnx.Embed) and module.dtype == module.param_dtype:
      module.dtype = module.embedding[...].dtype
