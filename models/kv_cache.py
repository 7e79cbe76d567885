"""The key/value cache of decoding: each attention layer keeps its keys and values.

Decoding a Linen model, and an NNX one::

    from models import kv_cache
    with kv_cache.decoding(length=64):  # A Linen model: its `cache` collection.
        logits, variables = model.apply({"params": p}, prompt, mutable=["cache"])

    model.init_cache(batch, 64)  # An NNX model: `nnx.Cache` variables.

A model attends through `kv_cache.attend` (Linen) or `kv_cache.attend_nnx` (NNX)
instead of `models.attention.attention` when it decodes. Each attention layer's
cache holds, per row of the batch:

- `key`, `value`: `[batch, length, kv_heads, head_dim]`, laid out by logical axes
  (`batch`, `cache_length`, the heads' name, `kv`), so a strategy's rule table lays
  it out as it lays out the activations (`batch -> data`, `heads -> model`);
- `index`: `[batch]` int32, the slot the row's next token is written to, which is
  also that token's position in its sequence.

A call with `T` tokens per row writes their keys and values at `index ..
index + T - 1` of each row, attends each of those tokens to the slots at or before
its own position (and inside a sliding `window`), and advances `index` by `T`. So a
prefill of a right-padded batch of prompts followed by setting each row's `index`
to its prompt's length (`set_index`) continues each row at its own length: the pad
slots are written over before any later token can see them.

A Linen model's cache is the `cache` collection, made on the first call under
`decoding(length)` (a layer stack stacks it on `layer` like the parameters). An
NNX model makes its own `nnx.Cache` variables in an `init_cache(batch, length,
dtype)` method (`models.llama.LlamaLM.init_cache`, with `cache_variables`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from models.attention import cached_attention
from strategies.tracing import Steering

#: The logical name of the cache's slot axis (no rule maps it: each device holds every slot).
CACHE_LENGTH = "cache_length"


@dataclasses.dataclass(frozen=True)
class Decoding:
  """What a Linen model's attention needs to make its cache: how many slots."""

  length: int


_DECODING = Steering("kv_cache_decoding")


def decoding(length: int) -> contextlib.AbstractContextManager:
  """Linen models' attention layers use (and make, on the first call) a cache of `length`
  slots while this is active (a trace-time setting, like `strategies.context.active`)."""
  if length < 1:
    raise ValueError(f"kv_cache.decoding: length={length} must be >= 1.")
  return _DECODING.active(Decoding(length))


def current() -> Decoding | None:
  """The active `decoding` setting, or None (the model computes its whole input)."""
  return _DECODING.current()


def _names(heads_name: str) -> tuple[str, ...]:
  return ("batch", CACHE_LENGTH, heads_name, "kv")


def _write(cache: jax.Array, new: jax.Array, index: jax.Array, names) -> jax.Array:
  """`new [b, t, h, d]` written into `cache [b, L, h, d]` at each row's `index`."""
  out = jax.vmap(lambda c, n, i: jax.lax.dynamic_update_slice_in_dim(c, n, i, axis=0))(
      cache, new.astype(cache.dtype), index)
  return nn.with_logical_constraint(out, names)


def _step(key_cache, value_cache, index, q, k, v, heads_name, window, scale):
  """The new (key, value, index) and the attended queries."""
  names = _names(heads_name)
  key_cache = _write(key_cache, k, index, names)
  value_cache = _write(value_cache, v, index, names)
  positions = index[:, None] + jnp.arange(q.shape[1], dtype=jnp.int32)[None]
  out = cached_attention(q, key_cache, value_cache, positions, window=window, scale=scale)
  return key_cache, value_cache, index + q.shape[1], out


def attend(module: nn.Module, q: jax.Array, k: jax.Array, v: jax.Array, *,
           heads_name: str = "heads", window: int | None = None,
           scale: float | None = None) -> jax.Array:
  """A Linen attention layer's decoding step: `q`, `k`, `v` `[batch, T, heads, head_dim]` of
  the new tokens, their attention over every token so far out (the `cache` collection of
  `module` read and written; made with `decoding().length` slots on the first call)."""
  setting = current()
  if setting is None:
    raise RuntimeError("kv_cache.attend outside kv_cache.decoding(): the cache has no length.")
  b, _, kv, d = k.shape
  shape = (b, setting.length, kv, d)
  names = _names(heads_name)

  def zeros(shape, dtype, names):  # Boxed with its logical names, as parameters are.
    return lambda: nn.LogicallyPartitioned(jnp.zeros(shape, dtype), names)

  key = module.variable("cache", "key", zeros(shape, k.dtype, names))
  value = module.variable("cache", "value", zeros(shape, v.dtype, names))
  index = module.variable("cache", "index", zeros((b,), jnp.int32, ("batch",)))
  key.value, value.value, index.value, out = _step(
      key.value, value.value, index.value, q, k, v, heads_name, window, scale)
  return out


def cache_variables(batch: int, length: int, kv_heads: int, head_dim: int, *,
                    dtype: Any = jnp.float32, heads_name: str = "kv_heads",
                    leading: tuple[int, ...] = (),
                    leading_names: tuple[str, ...] = ()) -> dict[str, nnx.Cache]:
  """An NNX layer's cache: `key`, `value` and `index` variables (with `leading` axes in
  front, e.g. a layer stack's `(num_layers,)` named `("layer",)`)."""
  shape = (*leading, batch, length, kv_heads, head_dim)
  names = (*leading_names, *_names(heads_name))
  return dict(
      key=nnx.Cache(jnp.zeros(shape, dtype), out_sharding=names),
      value=nnx.Cache(jnp.zeros(shape, dtype), out_sharding=names),
      index=nnx.Cache(jnp.zeros((*leading, batch), jnp.int32),
                      out_sharding=(*leading_names, "batch")))


def attend_nnx(cache: dict, q: jax.Array, k: jax.Array, v: jax.Array, *,
               heads_name: str = "kv_heads", window: int | None = None,
               scale: float | None = None) -> jax.Array:
  """`attend` for an NNX layer whose `cache` holds `cache_variables`' variables."""
  key, value, index = cache["key"], cache["value"], cache["index"]
  new_key, new_value, new_index, out = _step(key.get_value(), value.get_value(),
                                             index.get_value(), q, k, v, heads_name, window,
                                             scale)
  key.set_value(new_key)
  value.set_value(new_value)
  index.set_value(new_index)
  return out


def set_index(cache: Any, index: jax.Array) -> Any:
  """`cache` (a model's cache as `ModelVariables.decode` returns it: nested dicts, leaves
  boxed with their logical names) with every layer's `index` set to `index [batch]`
  (broadcast over a layer axis in front)."""
  def visit(tree):
    if isinstance(tree, nn.meta.AxisMetadata):
      return tree.replace_boxed(jnp.broadcast_to(index.astype(jnp.int32),
                                                 nn.meta.unbox(tree).shape))
    if hasattr(tree, "items"):
      return {k: visit(v) if k == "index" or hasattr(v, "items") else v
              for k, v in tree.items()}
    return jnp.broadcast_to(index.astype(jnp.int32), tree.shape)

  return visit(cache)
