"""Attention's arithmetic on blocks of scores, which every method of `models.attention` runs.

A `Block` holds what one block of scores needs besides the queries, keys and values
(the masks by position and document, dropout's keep mask keyed by each weight's place,
the scale) and folds a block into the running (max, sum, weighted values) of an online
softmax (`Block.update`); `start` is that carry before any key, `finish` the attention
output it gives. Plain attention is one update over the whole sequence; `fold` runs the
updates by blocks of queries against blocks of keys, each rematerialised in the backward
pass (FlashAttention's schedule in XLA), which `blockwise` runs over a whole sequence and
the context methods over each chunk of keys a device holds.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.random import threefry2x32_p


class Block:
  """What one block of scores needs besides q, k, v (static or small), and the online
  softmax's update by one block (`update`)."""

  def __init__(self, *, causal, window, scale, rate, seed, total_heads, length):
    self.causal, self.window, self.scale, self.rate = causal, window, scale, rate
    self.seed, self.total_heads, self.length = seed, total_heads, length

  def allowed(self, q_index, k_index, q_seg, k_seg):
    """`[batch, lq, lk]`: which scores count (index: the tokens' places in the sequence)."""
    ok = q_seg[:, :, None] == k_seg[:, None, :]
    distance = q_index[:, None] - k_index[None, :]
    if self.causal:
      ok = ok & (distance >= 0)[None]
    if self.window is not None:
      ok = ok & (distance < self.window)[None]
    return ok

  def skipped(self, q_index, k_index) -> jax.Array | bool:
    """Whether every score of the block is masked by position alone (causal, window)."""
    skip = False
    if self.causal:
      skip = jnp.min(k_index) > jnp.max(q_index)
    if self.window is not None:
      skip = skip | (jnp.min(q_index) - jnp.max(k_index) >= self.window)
    return skip

  def keep(self, shape, batch_index, head_index, q_index, k_index):
    """Dropout's keep mask `[b, kv, g, lq, lk]` from each weight's (row, head, query, key)."""
    kv, g = shape[1:3]
    row = (batch_index[:, None, None] * self.total_heads
           + head_index.reshape(kv, g)[None]).astype(jnp.uint32)
    cell = (q_index[:, None] * self.length + k_index[None, :]).astype(jnp.uint32)
    x0 = jnp.broadcast_to(row[..., None, None], shape)
    x1 = jnp.broadcast_to(cell[None, None, None], shape)
    bits, _ = threefry2x32_p.bind(self.seed[0], self.seed[1], x0, x1)
    threshold = np.uint32(min(int(self.rate * 2.0**32), 2**32 - 1))
    return bits >= threshold

  def update(self, carry, q, k, v, allowed, extra_mask, drop_ids):
    """One block folded into the running (max, sum, weighted values)."""
    m, total, acc = carry
    s = jnp.einsum("bqkgd,bskd->bkgqs", q, k, preferred_element_type=jnp.float32)
    s = s.astype(jnp.float32) * self.scale
    ok = allowed[:, None, None]
    if extra_mask is not None:
      ok = ok & extra_mask
    s = jnp.where(ok, s, -jnp.inf)
    m_new = jnp.maximum(m, s.max(axis=-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.exp(s - m_safe[..., None])
    correction = jnp.exp(m - m_safe)
    total = total * correction + p.sum(axis=-1)
    if drop_ids is not None:
      keep = self.keep(p.shape, *drop_ids)
      p = jnp.where(keep, p / (1.0 - self.rate), 0.0)
    acc = acc * correction[..., None] + jnp.einsum(
        "bkgqs,bskd->bkgqd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return m_new, total, acc


def start(b, kv, g, lq, d):
  """The running (max, sum, weighted values) of `lq` queries before any key: float32
  `[b, kv, g, lq]`, `[b, kv, g, lq]` and `[b, kv, g, lq, d]`."""
  return (jnp.full((b, kv, g, lq), -jnp.inf, jnp.float32), jnp.zeros((b, kv, g, lq), jnp.float32),
          jnp.zeros((b, kv, g, lq, d), jnp.float32))


def finish(carry, dtype):
  """The attention output `[b, lq, heads, d]` in `dtype` of a carry (`start`): its weighted
  values over its sums, 0 for a query that saw no key."""
  _, total, acc = carry
  out = jnp.where(total[..., None] > 0, acc / jnp.where(total > 0, total, 1.0)[..., None], 0.0)
  b, kv, g, lq, d = out.shape
  return out.transpose(0, 3, 1, 2, 4).reshape(b, lq, kv * g, d).astype(dtype)


def _pad_to(x: jax.Array, length: int, axis: int, value=0) -> jax.Array:
  pad = length - x.shape[axis]
  if not pad:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, pad)
  return jnp.pad(x, widths, constant_values=value)


def _in_blocks(x: jax.Array, size: int, axis: int, value=0) -> jax.Array:
  """`x` padded along `axis` to whole blocks of `size` (with `value`), the blocks on a new
  leading axis: `[..., n * size, ...]` -> `[n, ..., size, ...]`."""
  n = -(-x.shape[axis] // size)
  x = _pad_to(x, n * size, axis, value)
  return jnp.moveaxis(x.reshape(x.shape[:axis] + (n, size) + x.shape[axis + 1:]), axis, 0)


def _out_of_blocks(x: jax.Array, axis: int, length: int) -> jax.Array:
  """`_in_blocks`' inverse: the blocks back along `axis`, the padding cut to `length`."""
  x = jnp.moveaxis(x, 0, axis)
  x = x.reshape(x.shape[:axis] + (x.shape[axis] * x.shape[axis + 1],) + x.shape[axis + 2:])
  return jax.lax.slice_in_dim(x, 0, length, axis=axis)


#: Where padding sits in the sequence: after every token, so no causal or windowed query
#: sees it (and padded queries, whose outputs are cut, see no real key).
_PAD_INDEX = 2**30


def fold(block: Block, size: int, carry, q, q_index, q_seg, k, v, k_index, k_seg, drop):
  """`carry`, the running (max, sum, weighted values) of the queries `q [b, lq, kv, g, d]`,
  with the keys and values `k`, `v [b, lk, kv, d]` folded in: blocks of `size` queries
  against blocks of `size` keys, each pair by the online softmax (`Block.update`), a pair
  the causal mask or the window covers skipped. Each query block's computation is
  rematerialised in the backward pass, and each block pair's scores within it, so what
  autodiff keeps is linear in the length: a query block's inputs, and while one is
  differentiated, its running sums per key block. Blockwise attention is one fold over
  the whole sequence; the context methods fold each block of keys a device holds.

  Args:
    q_index, k_index: `[lq]`, `[lk]`, the tokens' places in the sequence.
    q_seg, k_seg: `[b, lq]`, `[b, lk]`, their documents.
    drop: `(batch ids, head ids)` of dropout's keep mask, or None (no dropout).
  """
  lq = q.shape[1]
  pad = lambda index: jnp.concatenate(  # noqa: E731
      [index, _PAD_INDEX + jnp.arange(-index.shape[0] % size, dtype=index.dtype)])
  qb, q_indexb = _in_blocks(q, size, 1), _in_blocks(pad(q_index), size, 0)
  q_segb = _in_blocks(q_seg, size, 1, -1)  # Padding matches no real document.
  keys = (_in_blocks(k, size, 1), _in_blocks(v, size, 1), _in_blocks(pad(k_index), size, 0),
          _in_blocks(k_seg, size, 1, -1))
  m, total, acc = carry
  carries = (_in_blocks(m, size, 3, -jnp.inf), _in_blocks(total, size, 3),
             _in_blocks(acc, size, 3))
  update = jax.checkpoint(block.update)

  @jax.checkpoint
  def one_query_block(carry, qi, qi_index, qi_seg):
    def step(carry, blocks):
      kj, vj, kj_index, kj_seg = blocks
      allowed = block.allowed(qi_index, kj_index, qi_seg, kj_seg)
      ids = (*drop, qi_index, kj_index) if drop is not None else None
      carry = jax.lax.cond(block.skipped(qi_index, kj_index), lambda c, *_: c,
                           lambda c, kj, vj, allowed: update(c, qi, kj, vj, allowed, None, ids),
                           carry, kj, vj, allowed)
      return carry, None

    carry, _ = jax.lax.scan(step, carry, keys)
    return carry

  _, out = jax.lax.scan(lambda _, args: (None, one_query_block(*args)), None,
                        (carries, qb, q_indexb, q_segb))
  return tuple(_out_of_blocks(x, 3, lq) for x in out)


def blockwise(block: Block, size: int, dropout: bool, q, k, v, segment_ids, index):
  """Attention by blocks of `size` queries against blocks of `size` keys (`fold` over the
  whole sequence; `index`: `[length]`, the tokens' places in it)."""
  b, length, heads, d = q.shape
  kv = k.shape[2]
  drop = (jnp.arange(b), jnp.arange(heads)) if dropout else None
  carry = fold(block, size, start(b, kv, heads // kv, length, d),
               q.reshape(b, length, kv, heads // kv, d), index, segment_ids, k, v, index,
               segment_ids, drop)
  return finish(carry, q.dtype)
