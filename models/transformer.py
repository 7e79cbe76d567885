"""A small decoder-only transformer language model annotated with logical axes.

Every weight names its dimensions (`vocab`, `embed`, `heads`, `kv`, `mlp`,
and `layer` from the `LayerStack`); activations carry `batch`/`length`-first
constraints. A rule table decides the layout: `batch -> data` is data
parallelism, adding `embed -> data` shards weights and optimizer state over
the data axis (FSDP), `heads/mlp/vocab -> model` is tensor parallelism. With
no mesh and rules the annotations are no-ops.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from models import kv_cache
from models.attention import attention, check_length, sequence_positions
from models.layer_stack import LayerStack
from models.moe import MoeMlp, MoeOutput, RouterStats
from models.vocab import mask_padding, padded_size

_init = nn.initializers.normal(stddev=0.02)


def _param(init, names: tuple[str, ...]):
  return nn.with_logical_partitioning(init, names)


class DecoderBlock(nn.Module):
  """Pre-norm causal self-attention and MLP, `(x, segment_ids) -> (x, segment_ids)`: one
  layer of a `LayerStack` (the segment ids of a packed batch travel with the activations;
  None for rows that are not packed, so that attention may take a fused kernel).
  With `num_experts` the MLP is a mixture of experts (`models.moe.MoeMlp`, SwiGLU experts)
  and the carry also holds the router's statistics."""

  num_heads: int
  head_dim: int
  mlp_dim: int
  num_experts: int = 0
  num_experts_per_tok: int = 2
  capacity_factor: float | None = None
  moe_dispatch: str = "ragged"

  @nn.compact
  def __call__(self, carry: tuple) -> tuple:
    x, segment_ids, *stats = carry
    embed = x.shape[-1]
    norm = lambda name: nn.LayerNorm(  # noqa: E731 -- two identical norms.
        name=name, scale_init=_param(nn.initializers.ones, ("embed",)),
        bias_init=_param(nn.initializers.zeros, ("embed",)))
    y = norm("attention_norm")(x)
    def projection(name, shape, names):
      return self.param(name, _param(_init, names), shape)

    heads = (self.num_heads, self.head_dim)
    q, k, v = (jnp.einsum("ble,ehd->blhd", y,
                          projection(name, (embed, *heads), ("embed", "heads", "kv")))
               for name in ("query", "key", "value"))
    q, k, v = (nn.with_logical_constraint(t, ("batch", "length", "heads", "kv"))
               for t in (q, k, v))
    if kv_cache.current() is not None:  # Decoding: the new tokens over the cache.
      attended = kv_cache.attend(self, q, k, v)
    else:
      attended = attention(q, k, v, segment_ids=segment_ids)
    attended = nn.with_logical_constraint(attended, ("batch", "length", "heads", "kv"))
    out = jnp.einsum("blhd,hde->ble", attended,
                     projection("out", (*heads, embed), ("heads", "kv", "embed")))
    x = nn.with_logical_constraint(x + out, ("batch", "length", "embed"))

    y = norm("mlp_norm")(x)
    if self.num_experts:
      out, layer_stats = MoeMlp(self.mlp_dim, self.num_experts, self.num_experts_per_tok,
                                capacity_factor=self.capacity_factor,
                                dispatch=self.moe_dispatch, name="moe")(y)
      x = nn.with_logical_constraint(x + out, ("batch", "length", "embed"))
      return x, segment_ids, stats[0] + layer_stats
    h = nn.Dense(self.mlp_dim, use_bias=False, name="wi",
                 kernel_init=_param(_init, ("embed", "mlp")))(y)
    h = nn.with_logical_constraint(nn.gelu(h), ("batch", "length", "mlp"))
    out = nn.Dense(embed, use_bias=False, name="wo",
                   kernel_init=_param(_init, ("mlp", "embed")))(h)
    return nn.with_logical_constraint(x + out, ("batch", "length", "embed")), segment_ids


class TransformerLM(nn.Module):
  """Token ids `[batch, length]` -> next-token logits `[batch, length, vocab]`.

  A packed batch also passes `segment_ids` (each token's document, 0: padding) and
  `positions` (each token's place in its document); attention stays within a document.

  Attributes:
    vocab_size: number of token ids.
    num_layers: decoder blocks, a `LayerStack` (a scan over a `layer` axis, or pipeline
      stages under a strategy with a `stage` mesh axis).
    embed_dim, num_heads, head_dim, mlp_dim: widths (`embed`, `heads`, `kv`, `mlp`).
    max_len: the longest sequence the learned position embedding covers.
    vocab_multiple: the embedding and head rows are `vocab_size` rounded up to a multiple
      of this (`models.vocab`: what a layout that splits `vocab` needs); the padded
      logits are masked out of the softmax.
    num_experts: 0 (a dense MLP), or the experts of a mixture in every block
      (`models.moe`; each of width `mlp_dim`), the output then `MoeOutput`.
    num_experts_per_tok: the experts each token is routed to (top-k).
    capacity_factor: None (dropless), or each expert's capacity per sequence as a
      multiple of an even share (`models.moe.capacity`).
    moe_dispatch: `ragged` (grouped products of the tokens sorted by expert) or `einsum`
      (dense one-hot dispatch, with a capacity: the baseline `benchmarks/moe.py` measures).
  """

  #: The repeated block, by the class name `config.remat.modules` takes (the dry run's advice).
  REMAT_BLOCK = "DecoderBlock"

  vocab_size: int
  num_layers: int = 2
  embed_dim: int = 64
  num_heads: int = 4
  head_dim: int = 16
  mlp_dim: int = 256
  max_len: int = 128
  vocab_multiple: int = 1
  num_experts: int = 0
  num_experts_per_tok: int = 2
  capacity_factor: float | None = None
  moe_dispatch: str = "ragged"

  @nn.compact
  def __call__(self, tokens: jax.Array, segment_ids: jax.Array | None = None,
               positions: jax.Array | None = None) -> jax.Array | MoeOutput:
    length = tokens.shape[1]
    check_length(length, self.max_len)
    rows = padded_size(self.vocab_size, self.vocab_multiple)
    x = nn.Embed(rows, self.embed_dim, name="token_embedding",
                 embedding_init=_param(_init, ("vocab", "embed")))(tokens)
    table = self.param("position_embedding", _param(_init, ("length", "embed")),
                       (self.max_len, self.embed_dim))
    where = sequence_positions(*tokens.shape) if positions is None else positions
    x = nn.with_logical_constraint(x + jnp.take(table, where, axis=0),
                                   ("batch", "length", "embed"))
    block = dict(num_heads=self.num_heads, head_dim=self.head_dim, mlp_dim=self.mlp_dim,
                 num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                 capacity_factor=self.capacity_factor, moe_dispatch=self.moe_dispatch)
    carry = (x, segment_ids)
    if self.num_experts:
      carry += (RouterStats.zeros(tokens.shape[0], self.num_experts),)
    x, *_, stats = LayerStack(DecoderBlock, self.num_layers, block, name="blocks")(carry)
    x = nn.LayerNorm(name="final_norm", scale_init=_param(nn.initializers.ones, ("embed",)),
                     bias_init=_param(nn.initializers.zeros, ("embed",)))(x)
    logits = nn.Dense(rows, use_bias=False, name="logits",
                      kernel_init=_param(_init, ("embed", "vocab")))(x)
    logits = mask_padding(logits, self.vocab_size)
    logits = nn.with_logical_constraint(logits, ("batch", "length", "vocab"))
    return MoeOutput(logits, stats.total()) if self.num_experts else logits
