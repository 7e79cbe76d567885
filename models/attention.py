"""The attention every model here calls: plain on one device, context parallel over a mesh.

    from models.attention import attention, sequence_positions
    out = attention(q, k, v, segment_ids=segment_ids)   # q [batch, length, heads, head_dim]

Without a `context` mesh axis it runs by the method the trainer sets while it traces
(`using`, from `config.attention`): `plain` (the whole score matrix of each head at
once) or `blockwise` (FlashAttention's schedule in XLA: blocks of queries against
blocks of keys with an online softmax, its backward pass recomputing each block's
scores, so memory is linear in the length; a `mask` array falls back to plain; on a
GPU, cuDNN's fused kernel where it can express the call: `fused_fallback`, and
`config.attention.implementation`). Both
honour every argument below. Under a strategy whose mesh
has one (`strategies.context`), each device holds a shard of every sequence and
the same call runs by the configured method: the keys and values gathered over
`context` (`all_gather`), or passed round a ring of devices with the softmax
combined by a running log-sum-exp (`ring`). Either way the result is the one
device's, and the masks follow each token's place in the sequence, not in its
shard:

- `causal`: a token attends to itself and the tokens before it;
- `segment_ids` (`[batch, length]`, packed documents): only to tokens of its own
  document; 0 marks padding;
- `window`: only to itself and the `window - 1` tokens before it (Mistral's sliding
  window);
- `mask`: any other boolean mask `[batch | 1, heads | 1, length, length]`; only
  plain attention can take one (under a `context` axis it is refused).

Grouped-query attention: `k` and `v` may have fewer heads than `q` (query head `h`
reads key/value head `h // (heads / kv_heads)`, as Hugging Face's `repeat_kv`).

Dropout on the attention weights draws its mask from each weight's place in the
sequence and head (a counter-based hash of the key), not from the array's shape,
so a context-parallel run drops the same weights as one device.

A model's position embeddings (learned or rotary) must use each token's global
position too: the positions of a packed batch (`positions`), or
`sequence_positions(batch, length)`, which is `arange(length)` except under a
layout that holds the sequence in another order.

Every method runs the same arithmetic on blocks of scores (the masks, dropout's keep
mask, the online softmax): `models.attention_blocks`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.sharding import PartitionSpec

from models import attention_blocks as blocks
from strategies import context as context_lib
from strategies.context import ContextError
from strategies.tracing import Steering

__all__ = ["attention", "cached_attention", "sequence_positions", "ContextError", "Method",
           "using"]

#: How attention runs on a device's whole sequences (`config.attention.method`).
METHODS = ("plain", "blockwise")
#: What runs the blockwise method (`config.attention.implementation`), as
#: `jax.nn.dot_product_attention` names them: `auto` (cuDNN's fused kernel on a GPU where it
#: can express the call, XLA's blockwise schedule elsewhere), `xla` (XLA's schedule always)
#: or `cudnn` (the fused kernel; a call it cannot take is refused, naming why).
IMPLEMENTATIONS = ("auto", "xla", "cudnn")


@dataclasses.dataclass(frozen=True)
class Method:
  """How `attention` runs: on one device's whole sequence, or, under a `context` axis, on
  each chunk of keys a device attends to (the ring's held block, the all-gathered keys).

  Attributes:
    name: `plain` (every query's scores against every key at once: `[length, length]`
      per head) or `blockwise` (FlashAttention's schedule in XLA: blocks of `block_size`
      queries against blocks of keys with an online softmax, and a backward pass that
      recomputes each query block and each block pair's scores; memory linear in the
      length).
    block_size: the queries and keys of one block (`blockwise`).
    implementation: what runs `blockwise` on a device's whole sequence, one of
      `IMPLEMENTATIONS` (under a `context` axis the context methods run).
  """

  name: str = "plain"
  block_size: int = 512
  implementation: str = "auto"

  @classmethod
  def from_config(cls, config) -> Method:
    """`config.attention`'s method.

    Raises:
      ValueError: naming `config.attention.method`, `.block_size` or `.implementation`
        and what is accepted.
    """
    method = cls(name=config.attention.method, block_size=config.attention.block_size,
                 implementation=config.attention.implementation)
    if method.name not in METHODS:
      raise ValueError(f"config.attention.method={method.name!r} is not one of {METHODS}.")
    if method.implementation not in IMPLEMENTATIONS:
      raise ValueError(f"config.attention.implementation={method.implementation!r} is not one "
                       f"of {IMPLEMENTATIONS}.")
    if method.implementation != "auto" and method.name != "blockwise":
      raise ValueError(f"config.attention.implementation={method.implementation!r} chooses "
                       f"what runs the blockwise method, but config.attention.method="
                       f"{method.name!r}; set the method to 'blockwise', or leave the "
                       f"implementation 'auto'.")
    if not isinstance(method.block_size, int) or method.block_size < 1:
      raise ValueError(f"config.attention.block_size={method.block_size!r} must be an int "
                       f">= 1 (the queries and keys of one block).")
    return method


_METHOD = Steering("attention_method")


def using(method: Method | None) -> contextlib.AbstractContextManager:
  """Attention traced inside runs by `method` (None: as it is); the previous one on exit."""
  return contextlib.nullcontext() if method is None else _METHOD.active(method)


def at_init(method: Method | None) -> Method | None:
  """`method` for a model's init: the blockwise method in XLA. An init traces the model in
  its parameters' dtype, and only the parameters' shapes come out of it, so it asks no
  fused kernel (`implementation='cudnn'` takes bfloat16 or float16 operands)."""
  if method is None or method.name != "blockwise":
    return method
  return dataclasses.replace(method, implementation="xla")


def current_method() -> Method:
  """The method attention traced now runs by (`using`; plain by default)."""
  return _METHOD.current() or Method()


def _order(length: int) -> np.ndarray:
  plan = context_lib.current()
  return np.arange(length) if plan is None else plan.order(length)


def check_length(length: int, max_len: int) -> None:
  """Raises unless rows of `length` tokens fit a model of `max_len` positions (every
  family checks its input with this before anything is computed).

  Raises:
    ValueError: naming the batch's row length and `config.model.max_len`.
  """
  if length > max_len:
    raise ValueError(
        f"the batch's rows hold {length} tokens (its sequence length, packed or not), more "
        f"than the model's max_len={max_len} (config.model.max_len); set "
        f"config.model.max_len >= {length}, or make the rows at most {max_len} tokens.")


def sequence_positions(batch: int, length: int) -> jax.Array:
  """`[batch, length]` int32: the position in the sequence of each token as the model holds
  it (the load-balanced context layout holds them out of order)."""
  return jnp.broadcast_to(jnp.asarray(_order(length), jnp.int32), (batch, length))


def _key_words(rng: jax.Array) -> tuple[jax.Array, jax.Array]:
  if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
    rng = jax.random.key_data(rng)
  words = jnp.asarray(rng).reshape(-1).astype(jnp.uint32)
  return words[0], words[-1]


def _groups(heads: int, kv_heads: int) -> int:
  """The query heads per key/value head (grouped-query attention).

  Raises:
    ValueError: `heads` is not a multiple of `kv_heads`.
  """
  if heads % kv_heads:
    raise ValueError(f"attention: {heads} query heads are not a multiple of {kv_heads} "
                     f"key/value heads.")
  return heads // kv_heads


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *,
              segment_ids: jax.Array | None = None, causal: bool = True,
              window: int | None = None, mask: jax.Array | None = None,
              scale: float | None = None, dropout_rate: float = 0.0,
              dropout_rng: jax.Array | None = None,
              deterministic: bool = True) -> jax.Array:
  """Softmax attention of `q [batch, length, heads, head_dim]` over `k`, `v [batch, length,
  kv_heads, head_dim]`, `[batch, length, heads, head_dim]` out (see the module docstring).

  Args:
    segment_ids: `[batch, length]` ints, the document of each token of a packed row (0:
      padding); None: one document per row.
    causal: mask the tokens after each query.
    window: a token sees itself and the `window - 1` tokens before it; None: all.
    mask: a boolean mask `[batch | 1, heads | 1, length, length]` (True: attend), plain
      attention only.
    scale: the scores' factor; None: `1 / sqrt(head_dim)`.
    dropout_rate, dropout_rng, deterministic: dropout on the attention weights, active
      when `deterministic` is False and the rate above 0.

  Raises:
    ContextError: under a `context` axis, a `mask` (the methods build theirs from the
      tokens' places) or a length that does not split into the layout's chunks.
  """
  b, length, heads, d = q.shape
  _groups(heads, k.shape[2])
  plan = context_lib.current()
  context_lib.record_call(plan.method if plan else current_method().name)
  dropout = dropout_rate > 0.0 and not deterministic
  if dropout and dropout_rng is None:
    raise ValueError("attention: dropout_rate > 0 outside deterministic mode needs a "
                     "dropout_rng.")
  seed = _key_words(dropout_rng) if dropout else (jnp.uint32(0), jnp.uint32(0))
  block = blocks.Block(causal=causal, window=window, scale=scale or 1.0 / math.sqrt(d),
                       rate=float(dropout_rate), seed=seed, total_heads=heads, length=length)
  packed = segment_ids is not None
  if segment_ids is None:
    segment_ids = jnp.zeros((b, length), jnp.int32)
  if plan is None:
    method = current_method()
    if method.name == "blockwise" and mask is None:  # A mask array is [length, length].
      fused = _fused_where_it_can(method, block, q, k, v, packed=packed, dropout=dropout,
                                  window=window, causal=causal)
      if fused is not None:
        return fused
      return blocks.blockwise(block, min(method.block_size, length), dropout, q, k, v,
                              segment_ids, jnp.asarray(_order(length)))
    if method.implementation == "cudnn":
      _refuse_cudnn("a mask array (only plain attention takes one)")
    return _plain(block, q, k, v, segment_ids, mask, dropout)
  if current_method().implementation == "cudnn":
    _refuse_cudnn(f"the sequence is split over the {plan.axis!r} mesh axis, where the "
                  f"context methods ({plan.method!r}) run")
  if mask is not None:
    raise ContextError(
        f"attention(mask=...) under the {plan.axis!r} mesh axis ({plan.axis}={plan.size}, "
        f"method {plan.method!r}): the context methods build their masks from each token's "
        f"place in the sequence (causal, segment_ids, window) and cannot honour a mask array "
        f"of the whole sequence. Express it with those arguments, or train without a "
        f"{plan.axis!r} axis.")
  plan.check_length(length)
  return _context_parallel(plan, block, q, k, v, segment_ids, dropout)


def cached_attention(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array, *,
                     window: int | None = None, scale: float | None = None) -> jax.Array:
  """Causal attention of new tokens over a key/value cache (`models.kv_cache`).

  Args:
    q: `[batch, T, heads, head_dim]`, the new tokens' queries.
    k, v: `[batch, slots, kv_heads, head_dim]`, the cache: slot `s` holds the token at
      position `s` of its row.
    positions: `[batch, T]` ints, each new token's position; it attends to the slots at or
      before it (and, with `window`, after `position - window`).

  Raises:
    ContextError: under a `context` mesh axis (a cache holds whole sequences).
  """
  plan = context_lib.current()
  if plan is not None:
    raise ContextError(
        f"decoding with a key/value cache under the {plan.axis!r} mesh axis "
        f"({plan.axis}={plan.size}): the cache holds each sequence whole on a device. Decode "
        f"under a layout without a {plan.axis!r} axis.")
  b, lq, heads, d = q.shape
  kv = k.shape[2]
  g = _groups(heads, kv)
  slots = jnp.arange(k.shape[1], dtype=jnp.int32)
  distance = positions[:, :, None] - slots[None, None, :]
  allowed = distance >= 0
  if window is not None:
    allowed = allowed & (distance < window)
  block = blocks.Block(causal=False, window=None, scale=scale or 1.0 / math.sqrt(d), rate=0.0,
                       seed=None, total_heads=heads, length=k.shape[1])
  carry = block.update(blocks.start(b, kv, g, lq, d), q.reshape(b, lq, kv, g, d), k, v, allowed,
                       None, None)
  return blocks.finish(carry, q.dtype)


def _plain(block, q, k, v, segment_ids, mask, dropout):
  b, length, heads, d = q.shape
  kv = k.shape[2]
  g = heads // kv
  index = jnp.asarray(_order(length))
  extra = None
  if mask is not None:
    mask = jnp.broadcast_to(mask, (mask.shape[0], mask.shape[1], length, length))
    extra = jnp.broadcast_to(mask, (b, heads, length, length)).reshape(b, kv, g, length, length)
  drop = (jnp.arange(b), jnp.arange(heads), index, index) if dropout else None
  allowed = block.allowed(index, index, segment_ids, segment_ids)
  carry = block.update(blocks.start(b, kv, g, length, d), q.reshape(b, length, kv, g, d), k, v,
                       allowed, extra, drop)
  return blocks.finish(carry, q.dtype)


# -- cuDNN's fused attention (a GPU) ---------------------------------------------------------


def fused_fallback(q: jax.Array, k: jax.Array, *, packed: bool, dropout: bool,
                   window: int | None, causal: bool) -> str | None:
  """Why blockwise attention cannot run as cuDNN's fused kernel
  (`jax.nn.dot_product_attention(implementation='cudnn')`) on a GPU, or None when it can:
  cuDNN takes bf16 or fp16 operands with a head width that is a multiple of 8 up to 128,
  and expresses a causal mask and a causal sliding window, but not packed documents
  (`segment_ids`), this module's position-keyed attention dropout, or a window without
  the causal mask. Those calls run blockwise in XLA."""
  if q.dtype not in (jnp.bfloat16, jnp.float16) or k.dtype != q.dtype:
    return f"operands of {q.dtype} (cuDNN's kernel takes bfloat16 or float16)"
  if q.shape[-1] % 8 or q.shape[-1] > 128:
    return f"head width {q.shape[-1]} (a multiple of 8 up to 128)"
  if packed:
    return "segment_ids (packed documents)"
  if dropout:
    return "attention dropout"
  if window is not None and not causal:
    return "a window without the causal mask"
  return None


def _backend() -> str:
  return jax.default_backend()


_LOGGED: set[str] = set()


def _fused_where_it_can(method: Method, block: blocks.Block, q, k, v,
                        **call) -> jax.Array | None:
  """This call as cuDNN's fused kernel, or None where XLA's blockwise schedule runs it
  (`method.implementation`; `auto` says why once per reason in the log on a GPU)."""
  if method.implementation == "xla":
    return None
  backend = _backend()
  reason = (f"the backend is {backend}, not a GPU" if backend != "gpu"
            else fused_fallback(q, k, **call))
  if reason is None:
    try:
      return _fused(block, q, k, v, "cudnn")
    except (NotImplementedError, RuntimeError, ValueError) as e:  # jax's own refusals.
      reason = f"jax.nn.dot_product_attention(implementation='cudnn') refused it: {e}"
  if method.implementation == "cudnn":
    _refuse_cudnn(reason)
  if backend == "gpu" and reason not in _LOGGED:
    _LOGGED.add(reason)
    logging.info("attention: XLA's blockwise schedule instead of cuDNN's fused kernel: %s",
                 reason)
  return None


def _refuse_cudnn(reason: str):
  raise ValueError(
      f"config.attention.implementation='cudnn': this attention call cannot run as cuDNN's "
      f"fused kernel: {reason}. Set it to 'auto' (cuDNN where it can, XLA's blockwise "
      f"schedule elsewhere) or 'xla'.")


def _fused(block: blocks.Block, q, k, v, implementation: str | None) -> jax.Array:
  """`jax.nn.dot_product_attention` with this call's causal mask, window and scale
  (`implementation`: 'cudnn' on a GPU; None, XLA's, to check the mapping elsewhere)."""
  window = None if block.window is None else (block.window - 1, 0)
  return jax.nn.dot_product_attention(q, k, v, scale=block.scale, is_causal=block.causal,
                                      local_window_size=window,
                                      implementation=implementation).astype(q.dtype)


def _linear_index(axes: tuple[str, ...]) -> jax.Array:
  """This device's index along `axes` taken together (0 without axes)."""
  index = jnp.int32(0)
  for a in axes:
    index = index * jax.lax.axis_size(a) + jax.lax.axis_index(a)
  return index


def _context_parallel(plan, block, q, k, v, segment_ids, dropout):
  b, length, heads, d = q.shape
  kv_heads = k.shape[2]
  group = heads // kv_heads
  C, axis = plan.size, plan.axis
  batch_entry = plan.batch_axes or None
  heads_entry = plan.heads_axes or None
  if kv_heads == heads or plan.kv_heads_axes == plan.heads_axes:
    kv_entry = heads_entry
  elif not plan.kv_heads_axes:
    kv_entry = None  # Each device picks its query heads' key/value heads.
  else:
    raise ContextError(
        f"attention: the rules lay 'heads' over {plan.heads_axes} and 'kv_heads' over "
        f"{plan.kv_heads_axes}; under a context axis key/value heads go with the query heads "
        f"or are replicated (('kv_heads', None)).")
  order = np.asarray(plan.order(length), np.int32)
  chunk = length // C
  method = current_method()  # Blockwise: each chunk of keys folded in by blocks.
  block_size = method.block_size if method.name == "blockwise" else 0

  def body(q, k, v, seg):
    i = jax.lax.axis_index(axis)
    lb, lq, hl = q.shape[0], q.shape[1], q.shape[2]
    head0 = _linear_index(plan.heads_axes) * hl if heads_entry else jnp.int32(0)
    if kv_entry is None and heads_entry:  # Replicated key/value heads: this device's.
      ids = (head0 + jnp.arange(hl)) // group
      k, v = jnp.take(k, ids, axis=2), jnp.take(v, ids, axis=2)
    kl = k.shape[2]
    g = hl // kl
    qg = q.reshape(lb, lq, kl, g, d)
    q_index = jax.lax.dynamic_slice_in_dim(jnp.asarray(order), i * chunk, chunk)
    batch0 = _linear_index(plan.batch_axes) * lb if batch_entry else jnp.int32(0)
    drop_base = (batch0 + jnp.arange(lb), head0 + jnp.arange(hl)) if dropout else None
    all_seg = jax.lax.all_gather(seg, axis, axis=1, tiled=True)
    carry = blocks.start(lb, kl, g, lq, d)
    if plan.method == "all_gather":
      k_all = jax.lax.all_gather(k, axis, axis=1, tiled=True)
      v_all = jax.lax.all_gather(v, axis, axis=1, tiled=True)
      k_index = jnp.asarray(order)
      if block_size:
        carry = blocks.fold(block, min(block_size, lq), carry, qg, q_index, seg, k_all, v_all,
                            k_index, all_seg, drop_base)
        return blocks.finish(carry, q.dtype)
      drop = (*drop_base, q_index, k_index) if dropout else None
      allowed = block.allowed(q_index, k_index, seg, all_seg)
      carry = block.update(carry, qg, k_all, v_all, allowed, None, drop)
      return blocks.finish(carry, q.dtype)

    update = jax.checkpoint(block.update)  # Each block's scores recomputed for the backward.

    def fold(c, qa, qa_index, qa_seg, kb, vb, kb_index, kb_seg):
      """One chunk of keys into the running sums of one chunk of queries: in blocks of
      `config.attention.block_size` under the blockwise method (`blocks.fold`), else at once."""
      if block_size:
        return blocks.fold(block, min(block_size, qa.shape[1]), c, qa, qa_index, qa_seg, kb,
                           vb, kb_index, kb_seg, drop_base)
      drop = (*drop_base, qa_index, kb_index) if dropout else None
      return update(c, qa, kb, vb, block.allowed(qa_index, kb_index, qa_seg, kb_seg), None,
                    drop)

    # In the load-balanced order a device's queries, and each block of keys, are an early and
    # a late chunk: of a block's four chunk pairs the causal mask covers one or two whole
    # (the early queries never see a late chunk), so each pair is skipped on its own.
    pieces = 2 if plan.load_balance else 1
    sub = lq // pieces
    part = lambda x, p, axis=1: jax.lax.slice_in_dim(x, p * sub, (p + 1) * sub, axis=axis)  # noqa: E731
    perm = [(j, (j + 1) % C) for j in range(C)]

    def visit(carries, k, v, s):
      """This device's queries against the block it holds at step `s` (device i - s's)."""
      origin = (i - s) % C
      k_index = jax.lax.dynamic_slice_in_dim(jnp.asarray(order), origin * chunk, chunk)
      k_seg = jax.lax.dynamic_slice_in_dim(all_seg, origin * chunk, chunk, axis=1)
      carries = list(carries)
      for a in range(pieces):
        qa, qa_index = part(qg, a), part(q_index, a, 0)
        for b in range(pieces):
          if block.causal and (a, b) == (0, 1):  # Early queries, late keys: always masked.
            continue
          kb_index = part(k_index, b, 0)
          carries[a] = jax.lax.cond(
              block.skipped(qa_index, kb_index), lambda c, *_: c,
              lambda c, qs, kb, vb, ks, qa=qa, qa_index=qa_index, kb_index=kb_index: fold(
                  c, qa, qa_index, qs, kb, vb, kb_index, ks),
              carries[a], part(seg, a), part(k, b), part(v, b), part(k_seg, b))
      return carries

    def step(state, s):  # Attend to the block held, then pass it to the next device.
      carries, k, v = state
      carries = visit(carries, k, v, s)
      return (carries, jax.lax.ppermute(k, axis, perm), jax.lax.ppermute(v, axis, perm)), None

    carries = [blocks.start(lb, kl, g, sub, d) for _ in range(pieces)]
    (carries, k, v), _ = jax.lax.scan(step, (carries, k, v), jnp.arange(C - 1))
    carries = visit(carries, k, v, C - 1)
    return jnp.concatenate([blocks.finish(c, q.dtype) for c in carries], axis=1)

  spec_q = PartitionSpec(batch_entry, axis, heads_entry, None)
  spec_kv = PartitionSpec(batch_entry, axis, kv_entry, None)
  spec_seg = PartitionSpec(batch_entry, axis)
  return jax.shard_map(body, in_specs=(spec_q, spec_kv, spec_kv, spec_seg), out_specs=spec_q,
                       check_vma=False)(q, k, v, segment_ids)
