"""Mixture-of-experts feed-forward: a top-k router and stacked experts, each token through its
chosen experts only.

A block replaces its MLP with `MoeFeedForward` (NNX) or `MoeMlp` (Linen). Both hold

- `router/kernel [embed, None]` (the expert dimension unnamed: every device holds the
  whole router): each token's logits over the experts; the router
  takes a softmax over all of them and keeps the `top_k` largest, renormalised over the
  chosen k when `normalize` (Mixtral's routing; Qwen3-MoE's `norm_topk_prob`);
- `gate_proj`, `up_proj [expert, embed, mlp]` and `down_proj [expert, mlp, embed]`: the
  experts' SwiGLU weights stacked on the `expert` logical axis, so the rule
  `("expert", "expert")` places each device's experts (`strategies.expert`).

How the tokens reach their experts (`expert_ffn`):

- dropless (`capacity_factor=None`): every token's k choices are sorted by expert and
  multiplied by `jax.lax.ragged_dot` with the experts' group sizes; no token is dropped;
- with a capacity factor: in each sequence an expert takes at most
  `capacity = ceil(capacity_factor * length * top_k / experts)` of the choices, first
  choices before second ones, earlier tokens first; the others are dropped (the token
  keeps its residual) and counted. The group is the sequence because that is the one
  unit every layout keeps whole on a device: which tokens drop does not depend on the
  mesh, so a run drops the same tokens on one device as on 64.

Under a strategy with an `expert` mesh axis the experts are split over it and each
device's tokens travel to the devices holding their experts and back by all-to-all
inside the step (`strategies.expert`); elsewhere the same sort and grouped products run
on each device's own tokens.

The router's statistics travel with the activations through the layer stack, per row
(`RouterStats`), so a pipeline microbatches them like any carry; `summarize` turns their
sums into the load-balancing loss (Switch/Mixtral form, as transformers'
`load_balancing_loss_func` over all layers), the router z-loss (ST-MoE), each expert's
share of the choices and the dropped fraction.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from jax import custom_batching
from jax.sharding import PartitionSpec

from strategies import expert as expert_lib

#: The logical name of the experts' axis.
EXPERT = "expert"


class MoeError(ValueError):
  """An MoE configuration that cannot work (refused before compute)."""


class RouterStats(NamedTuple):
  """Per row, summed over its tokens (and over the layers it has passed): `counts [batch,
  experts]`, the choices routed to each expert (before any is dropped); `probs [batch,
  experts]`, the router's softmax probabilities; `z [batch]`, the squared log-sum-exp of
  the router logits; `dropped [batch]`, the choices dropped for capacity; `tokens [batch]`,
  the tokens routed (one per token and layer)."""

  counts: jax.Array
  probs: jax.Array
  z: jax.Array
  dropped: jax.Array
  tokens: jax.Array

  @classmethod
  def zeros(cls, batch: int, num_experts: int) -> RouterStats:
    return cls(jnp.zeros((batch, num_experts)), jnp.zeros((batch, num_experts)),
               jnp.zeros((batch,)), jnp.zeros((batch,)), jnp.zeros((batch,)))

  def __add__(self, other: RouterStats) -> RouterStats:  # type: ignore[override]
    return RouterStats(*(a + b for a, b in zip(self, other, strict=True)))

  def total(self) -> RouterStats:
    """Summed over the rows (`counts`, `probs [experts]`, the others scalars)."""
    return RouterStats(*(a.sum(0) for a in self))


class MoeOutput(NamedTuple):
  """A mixture of experts' output: `logits`, and `router`, its `RouterStats` summed over the
  batch's rows and the layers (`summarize` turns them into losses and metrics)."""

  logits: jax.Array
  router: RouterStats


def check_fields(num_experts: int, top_k: int, capacity_factor: float | None,
                 dispatch: str = "ragged") -> None:
  """Raises `MoeError` naming `config.model`'s field for experts, top-k, capacity or
  dispatch that cannot route."""
  if dispatch not in DISPATCHES:
    raise MoeError(f"config.model.moe_dispatch={dispatch!r} is not one of {DISPATCHES}.")
  if num_experts < 1:
    raise MoeError(f"config.model.num_experts={num_experts} must be at least 1.")
  if not 1 <= top_k <= num_experts:
    raise MoeError(f"config.model.num_experts_per_tok={top_k} must be between 1 and "
                   f"config.model.num_experts={num_experts}: a token chooses that many "
                   f"distinct experts.")
  if capacity_factor is not None and not capacity_factor > 0:
    raise MoeError(f"config.model.capacity_factor={capacity_factor!r} must be above 0 (the "
                   f"experts' capacity is capacity_factor x length x top_k / experts per "
                   f"sequence), or None for dropless routing.")


def capacity(length: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
  """Each expert's choices per sequence: `ceil(capacity_factor * length * top_k / experts)`."""
  return max(1, math.ceil(capacity_factor * length * top_k / num_experts))


def route(logits: jax.Array, top_k: int, normalize: bool) -> tuple[jax.Array, jax.Array,
                                                                  jax.Array]:
  """`logits [batch, length, experts]` -> (gates `[batch, length, k]` float32, expert ids
  `[batch, length, k]`, probabilities `[batch, length, experts]`)."""
  probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
  gates, ids = jax.lax.top_k(probs, top_k)
  if normalize:
    gates = gates / gates.sum(axis=-1, keepdims=True)
  return gates, ids, probs


def within_capacity(ids: jax.Array, num_experts: int, limit: int | None) -> jax.Array:
  """Which of the choices `ids [batch, length, k]` an expert keeps (all when `limit` is None):
  in each sequence the first `limit` choices of each expert, all first choices before the
  second ones, earlier tokens first."""
  if limit is None:
    return jnp.ones(ids.shape, bool)
  return _slots(ids, num_experts) < limit


def _slots(ids: jax.Array, num_experts: int) -> jax.Array:
  """Each choice's place `[batch, length, k]` among its expert's choices in its sequence:
  first choices before second ones, earlier tokens first."""
  b, length, k = ids.shape
  ordered = ids.transpose(0, 2, 1).reshape(b, k * length)  # Choice rank, then position.
  onehot = jax.nn.one_hot(ordered, num_experts, dtype=jnp.int32)
  slot = (jnp.cumsum(onehot, axis=1) * onehot).sum(-1) - 1
  return slot.reshape(b, k, length).transpose(0, 2, 1)


def router_stats(logits: jax.Array, probs: jax.Array, ids: jax.Array,
                 keep: jax.Array) -> RouterStats:
  """One layer's `RouterStats` of the batch."""
  num_experts = logits.shape[-1]
  counts = jax.nn.one_hot(ids, num_experts, dtype=jnp.float32).sum(axis=(1, 2))
  lse = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)
  tokens = jnp.full(logits.shape[:1], logits.shape[1], jnp.float32)
  return RouterStats(counts, probs.sum(axis=1), (lse ** 2).sum(axis=1),
                     (~keep).sum(axis=(1, 2)).astype(jnp.float32), tokens)


def summarize(stats: RouterStats) -> dict[str, jax.Array]:
  """The losses and metrics of a batch's router statistics (summed over layers):

  - `load_balance`: `experts * sum_e f_e * P_e`, `f_e` the choices routed to expert `e`
    and `P_e` its mean probability, both per token over all layers (transformers'
    `load_balancing_loss_func`; `top_k` when perfectly balanced);
  - `router_z`: the mean over tokens and layers of the squared log-sum-exp;
  - `dropped_fraction`: the choices dropped for capacity, of all choices;
  - `expert_share`: `[experts]` each expert's share of the choices (1 / experts each when
    balanced; one near 1 is routing collapse).
  """
  num_experts = stats.counts.shape[-1]
  counts = stats.counts.reshape(-1, num_experts).sum(0)
  probs = stats.probs.reshape(-1, num_experts).sum(0)
  tokens = jnp.maximum(stats.tokens.sum(), 1.0)
  choices = jnp.maximum(counts.sum(), 1.0)
  return {"load_balance": num_experts * jnp.sum((counts / tokens) * (probs / tokens)),
          "router_z": stats.z.sum() / tokens,
          "dropped_fraction": stats.dropped.sum() / choices,
          "expert_share": counts / choices}


def _one_by_one(fn):
  """A `custom_vmap` rule: the batch's elements through `fn` one after another (`lax.map`),
  the unbatched arguments shared."""
  def rule(axis_size, in_batched, *args):
    args = tuple(a if b else jnp.broadcast_to(a, (axis_size, *a.shape))
                 for a, b in zip(args, in_batched, strict=True))
    out = jax.lax.map(lambda a: fn(*a), args)
    return out, jax.tree.map(lambda _: True, out)
  return rule


@custom_batching.custom_vmap
def _ragged_dot(x, w, sizes):
  return jax.lax.ragged_dot(x, w, sizes)


@custom_batching.custom_vmap
def _ragged_dot_vjp(x, w, sizes, cotangent):
  return jax.vjp(lambda x, w: jax.lax.ragged_dot(x, w, sizes), x, w)[1](cotangent)


_ragged_dot.def_vmap(_one_by_one(_ragged_dot))
_ragged_dot_vjp.def_vmap(_one_by_one(_ragged_dot_vjp))


@jax.custom_vjp
def grouped_matmul(x: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
  """`jax.lax.ragged_dot(x, w, sizes)` (rows of `x` sorted by group, `sizes` per group, rows
  past their sum give 0) that also runs under `vmap` and its gradients: `ragged_dot`'s own
  batching takes only arguments all batched on their first axis, which an init's
  size-one `vmap` (unbatched weights) or an ensemble's is not; there each element runs
  in turn."""
  return _ragged_dot(x, w, sizes)


def _grouped_fwd(x, w, sizes):
  return _ragged_dot(x, w, sizes), (x, w, sizes)


def _grouped_bwd(residuals, cotangent):
  x, w, sizes = residuals
  dx, dw = _ragged_dot_vjp(x, w, sizes, cotangent)
  return dx, dw, None


grouped_matmul.defvjp(_grouped_fwd, _grouped_bwd)


def _grouped_swiglu(xs: jax.Array, sizes: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                    w_down: jax.Array) -> jax.Array:
  """Rows `xs` sorted by expert (`sizes` per expert; rows past their sum give 0) through
  their expert's SwiGLU."""
  h = jax.nn.silu(grouped_matmul(xs, w_gate, sizes)) * grouped_matmul(xs, w_up, sizes)
  return grouped_matmul(h.astype(xs.dtype), w_down, sizes)


def _combine(y_choices: jax.Array, gates: jax.Array, keep: jax.Array) -> jax.Array:
  b, length, k = gates.shape
  weights = (gates * keep).astype(y_choices.dtype).reshape(-1, 1)
  return (y_choices * weights).reshape(b, length, k, -1).sum(axis=2)


def _sorted_choices(ids: jax.Array, keep: jax.Array, num_experts: int
                    ) -> tuple[jax.Array, jax.Array]:
  """The choices `ids [batch, length, k]`, flattened, in order of expert (`order`), and each
  sorted choice's expert; a dropped choice sorts last, as expert `num_experts`."""
  key = jnp.where(keep, ids, num_experts).reshape(-1)
  order = jnp.argsort(key, stable=True)
  return order, key[order]


def _buffer_rows(choices: int, rows: int, local: int, limit: int | None) -> int:
  """The most choices one device can send another: all of its `choices` (dropless), or each
  of its `rows`' capacity `limit` for each of that device's `local` experts."""
  return choices if limit is None else min(choices, rows * local * limit)


def _local_experts(x, ids, gates, keep, w_gate, w_up, w_down) -> jax.Array:
  """All experts here: the kept choices sorted by expert, one grouped product each."""
  b, length, d = x.shape
  k, num_experts = ids.shape[-1], w_gate.shape[0]
  order, expert = _sorted_choices(ids, keep, num_experts)
  sizes = jnp.bincount(expert, length=num_experts + 1)[:num_experts]
  tokens = x.reshape(b * length, d)
  ys = _grouped_swiglu(tokens[order // k], sizes, w_gate, w_up, w_down)
  return _combine(jnp.zeros_like(ys).at[order].set(ys), gates, keep)


def _exchanged_experts(plan: expert_lib.ExpertPlan, limit: int | None, x, ids, gates, keep,
                       w_gate, w_up, w_down) -> jax.Array:
  """One device's tokens and `experts / size` experts: each kept choice goes to the device
  holding its expert in a fixed-size buffer (`jax.lax.all_to_all`), is multiplied there,
  and comes back the same way."""
  size, local = plan.size, w_gate.shape[0]
  b, length, d = x.shape
  k = ids.shape[-1]
  n = b * length * k
  slots = _buffer_rows(n, b, local, limit)
  order, expert = _sorted_choices(ids, keep, size * local)
  dest = expert // local  # `size` for a dropped choice.
  per_dest = jnp.bincount(dest, length=size + 1)
  starts = jnp.cumsum(per_dest) - per_dest
  where = jnp.where(dest < size, dest * slots + jnp.arange(n) - starts[dest], size * slots)
  tokens = x.reshape(b * length, d)
  send = jnp.zeros((size * slots + 1, d), x.dtype).at[where].set(tokens[order // k])
  send_ids = jnp.full((size * slots + 1,), local, jnp.int32).at[where].set(expert % local)
  received, received_ids = (
      plan.all_to_all(a[:-1].reshape(size, slots, *a.shape[1:])) for a in (send, send_ids))
  flat_ids = received_ids.reshape(-1)  # `local` marks an empty slot.
  arrived = jnp.argsort(flat_ids, stable=True)
  sizes = jnp.bincount(flat_ids, length=local + 1)[:local]
  ys = _grouped_swiglu(received.reshape(-1, d)[arrived], sizes, w_gate, w_up, w_down)
  done = jnp.zeros_like(ys).at[arrived].set(ys).reshape(size, slots, d)
  back = plan.all_to_all(done).reshape(size * slots, d)
  back = jnp.concatenate([back, jnp.zeros((1, d), back.dtype)])
  y_choices = jnp.zeros((n, d), back.dtype).at[order].set(back[where])
  return _combine(y_choices, gates, keep)


def einsum_experts(x: jax.Array, ids: jax.Array, gates: jax.Array, w_gate: jax.Array,
                   w_up: jax.Array, w_down: jax.Array, limit: int) -> jax.Array:
  """The same as `expert_ffn` with a capacity of `limit` per expert and sequence, by dense
  one-hot dispatch and combine tensors `[batch, length, experts, limit]` and einsums (GShard's
  form): what `benchmarks/moe.py` measures the grouped products against. Its dispatch
  tensor grows with the square of the sequence length."""
  num_experts = w_gate.shape[0]
  slots = _slots(ids, num_experts)
  place = (jax.nn.one_hot(ids, num_experts, dtype=x.dtype)[..., None]
           * jax.nn.one_hot(slots, limit, dtype=x.dtype)[..., None, :])  # [b, l, k, e, c]
  dispatch = place.sum(2)
  combine = (place * gates.astype(x.dtype)[..., None, None]).sum(2)
  inputs = jnp.einsum("blec,bld->becd", dispatch, x)
  h = (jax.nn.silu(jnp.einsum("becd,edf->becf", inputs, w_gate))
       * jnp.einsum("becd,edf->becf", inputs, w_up))
  return jnp.einsum("blec,becd->bld", combine, jnp.einsum("becf,efd->becd", h, w_down))


def _ragged_exchanged_experts(plan: expert_lib.ExpertPlan, limit: int | None, x, ids, gates,
                              keep, w_gate, w_up, w_down) -> jax.Array:
  """`_exchanged_experts` by `jax.lax.ragged_all_to_all`: each device sends each other
  device exactly its choices for that device's experts (the sizes exchanged first), and
  the results come back into the sender's sorted order. The receiving buffer is sized as
  `_exchanged_experts`' (the worst case); what crosses the network is only what is used."""
  size, local = plan.size, w_gate.shape[0]
  b, length, d = x.shape
  k = ids.shape[-1]
  n = b * length * k
  slots = _buffer_rows(n, b, local, limit)
  order, expert = _sorted_choices(ids, keep, size * local)
  sizes = jnp.bincount(expert // local, length=size + 1)[:size].astype(jnp.int32)
  starts = (jnp.cumsum(sizes) - sizes).astype(jnp.int32)
  # [sender, receiver] sizes and starts of every device's sends.
  all_sizes = jax.lax.all_gather(sizes, plan.axis)
  all_starts = jax.lax.all_gather(starts, plan.axis)
  me = jax.lax.axis_index(plan.axis)
  placed = (jnp.cumsum(all_sizes, axis=0) - all_sizes)[me]  # Where mine land on each peer.
  received_sizes = all_sizes[:, me]
  received_starts = (jnp.cumsum(received_sizes) - received_sizes).astype(jnp.int32)

  def send(operand, output, offsets, counts, there, incoming):
    return jax.lax.ragged_all_to_all(operand, output, offsets, counts, there, incoming,
                                     axis_name=plan.axis)

  tokens = x.reshape(b * length, d)[order // k]
  received = send(tokens, jnp.zeros((size * slots, d), x.dtype), starts, sizes, placed,
                  received_sizes)
  received_ids = send((expert % local).astype(jnp.int32),
                      jnp.full((size * slots,), local, jnp.int32), starts, sizes, placed,
                      received_sizes)
  arrived = jnp.argsort(received_ids, stable=True)
  counts = jnp.bincount(received_ids, length=local + 1)[:local]
  ys = _grouped_swiglu(received[arrived], counts, w_gate, w_up, w_down)
  done = jnp.zeros_like(ys).at[arrived].set(ys)
  back = send(done, jnp.zeros((n, d), done.dtype), received_starts, received_sizes,
              all_starts[:, me], sizes)
  kept = (jnp.arange(n) < sizes.sum())[:, None]  # Dropped choices sort last: zero.
  y_choices = jnp.zeros((n, d), back.dtype).at[order].set(jnp.where(kept, back, 0))
  return _combine(y_choices, gates, keep)


def expert_ffn(x: jax.Array, ids: jax.Array, gates: jax.Array, keep: jax.Array,
               w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
               limit: int | None = None) -> jax.Array:
  """`x [batch, length, embed]` through each token's kept chosen experts, weighted by its
  gates: `sum_k gate_k * keep_k * expert_{ids_k}(x)`.

  Under a strategy's expert plan (`strategies.expert.current()`) this runs per device on
  its own rows (a `shard_map` over the batch's mesh axes and the `expert` axis), the
  choices exchanged by all-to-all when there is an `expert` axis; without one, on the
  whole batch.
  """
  plan = expert_lib.current()
  if plan is None:
    return _local_experts(x, ids, gates, keep, w_gate, w_up, w_down)
  plan.check_experts(w_gate.shape[0], "the experts' weights")
  rows = PartitionSpec(plan.batch_axes or None)
  weights = PartitionSpec(plan.axis) if plan.axis else PartitionSpec()
  exchanged = (_ragged_exchanged_experts if plan.exchange == "ragged_all_to_all" else
               _exchanged_experts)
  body = (_local_experts if plan.axis is None else
          lambda *a: exchanged(plan, limit, *a))
  return jax.shard_map(body, in_specs=(rows, rows, rows, rows, weights, weights, weights),
                       out_specs=rows, axis_names=set(plan.manual_axes),
                       check_vma=False)(x, ids, gates, keep, w_gate, w_up, w_down)


#: How tokens reach their experts: sorted, by grouped products (`expert_ffn`); or by dense
#: one-hot dispatch einsums (`einsum_experts`: with a capacity, without an `expert` axis).
DISPATCHES = ("ragged", "einsum")


def moe_forward(x: jax.Array, router_kernel: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                w_down: jax.Array, *, top_k: int, normalize: bool,
                capacity_factor: float | None,
                dispatch: str = "ragged") -> tuple[jax.Array, RouterStats]:
  """The MoE feed-forward of `x [batch, length, embed]` and the layer's router statistics."""
  num_experts = w_gate.shape[0]
  logits = jnp.einsum("ble,en->bln", x, router_kernel)
  gates, ids, probs = route(logits, top_k, normalize)
  limit = (None if capacity_factor is None else
           capacity(x.shape[1], top_k, num_experts, capacity_factor))
  keep = within_capacity(ids, num_experts, limit)
  if dispatch == "einsum":
    plan = expert_lib.current()
    if limit is None or (plan is not None and plan.axis):
      raise MoeError(f"config.model.moe_dispatch='einsum' needs a capacity "
                     f"(config.model.capacity_factor, now {capacity_factor}) and no "
                     f"'expert' mesh axis; use 'ragged' otherwise.")
    y = einsum_experts(x, ids, gates, w_gate, w_up, w_down, limit)
  else:
    y = expert_ffn(x, ids, gates, keep, w_gate, w_up, w_down, limit)
  y = nn.with_logical_constraint(y.astype(x.dtype), ("batch", "length", "embed"))
  return y, router_stats(logits, probs, ids, keep)


_init = nnx.initializers.normal(stddev=0.02)


class MoeFeedForward(nnx.Module):
  """NNX: `x [batch, length, embed] -> (y, RouterStats)`, the experts' SwiGLU of each token's
  top-k experts (see the module's docstring)."""

  def __init__(self, embed: int, mlp_dim: int, num_experts: int, top_k: int, *,
               normalize: bool = True, capacity_factor: float | None = None,
               rngs: nnx.Rngs):
    check_fields(num_experts, top_k, capacity_factor)
    self.top_k, self.normalize, self.capacity_factor = top_k, normalize, capacity_factor
    self.gate = nnx.Linear(embed, num_experts, use_bias=False, rngs=rngs,
                           kernel_init=nnx.with_partitioning(_init, ("embed", None)))

    def stacked(shape, names):
      return nnx.Param(nnx.with_partitioning(_init, names)(rngs.params(), shape))

    self.gate_proj = stacked((num_experts, embed, mlp_dim), (EXPERT, "embed", "mlp"))
    self.up_proj = stacked((num_experts, embed, mlp_dim), (EXPERT, "embed", "mlp"))
    self.down_proj = stacked((num_experts, mlp_dim, embed), (EXPERT, "mlp", "embed"))

  def __call__(self, x: jax.Array) -> tuple[jax.Array, RouterStats]:
    return moe_forward(x, self.gate.kernel[...], self.gate_proj[...], self.up_proj[...],
                       self.down_proj[...], top_k=self.top_k, normalize=self.normalize,
                       capacity_factor=self.capacity_factor)


class MoeMlp(nn.Module):
  """Linen: `x [batch, length, embed] -> (y, RouterStats)`, as `MoeFeedForward`."""

  mlp_dim: int
  num_experts: int
  top_k: int = 2
  normalize: bool = True
  capacity_factor: float | None = None
  dispatch: str = "ragged"

  @nn.compact
  def __call__(self, x: jax.Array) -> tuple[jax.Array, RouterStats]:
    check_fields(self.num_experts, self.top_k, self.capacity_factor, self.dispatch)
    embed = x.shape[-1]

    def param(name, shape, names):
      return self.param(name, nn.with_logical_partitioning(_init, names), shape)

    router = param("router", (embed, self.num_experts), ("embed", None))
    w_gate = param("gate_proj", (self.num_experts, embed, self.mlp_dim),
                   (EXPERT, "embed", "mlp"))
    w_up = param("up_proj", (self.num_experts, embed, self.mlp_dim), (EXPERT, "embed", "mlp"))
    w_down = param("down_proj", (self.num_experts, self.mlp_dim, embed),
                   (EXPERT, "mlp", "embed"))
    return moe_forward(x, router, w_gate, w_up, w_down, top_k=self.top_k,
                       normalize=self.normalize, capacity_factor=self.capacity_factor,
                       dispatch=self.dispatch)
