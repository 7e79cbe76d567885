"""GPT-2 (Linen), computing what Hugging Face's `GPT2LMHeadModel` computes.

The weights are HF's, in this project's layouts and logical names, so a
published GPT-2 loads through `trainer.interop.hf` (the mapping is
`trainer.interop.families.GPT2`) and every strategy can lay it out:

- `token_embedding/embedding [vocab, embed]` (tied: the head is its transpose),
  `position_embedding [length, embed]`;
- per layer, stacked on `layer` by a `LayerStack`: `ln_1`, `attn/c_attn/kernel
  [embed, 3, heads, kv]` (q, k and v fused as in HF's `c_attn`), `attn/c_proj/kernel
  [heads, kv, embed]`, `ln_2`, `mlp/c_fc/kernel [embed, mlp]`, `mlp/c_proj/kernel
  [mlp, embed]`, each with its bias;
- `ln_f`.

Pre-norm blocks, causal attention scaled by `1/sqrt(head_dim)`, GELU's tanh
approximation (HF's `gelu_new`), LayerNorm epsilon `layer_norm_epsilon`.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from models import kv_cache
from models.attention import attention, check_length, sequence_positions
from models.layer_stack import LayerStack
from models.vocab import mask_padding, padded_size

_init = nn.initializers.normal(stddev=0.02)


def _param(init, names: tuple[str | None, ...]):
  return nn.with_logical_partitioning(init, names)


def _norm(name: str, eps: float) -> nn.LayerNorm:
  return nn.LayerNorm(epsilon=eps, name=name,
                      scale_init=_param(nn.initializers.ones, ("embed",)),
                      bias_init=_param(nn.initializers.zeros, ("embed",)))


class GPT2Block(nn.Module):
  """`(x, segment_ids) -> (x, segment_ids)`: pre-norm causal self-attention, then the MLP,
  each added to the residual."""

  num_heads: int
  head_dim: int
  mlp_dim: int
  layer_norm_epsilon: float = 1e-5
  dropout_rate: float = 0.0
  deterministic: bool = True

  @nn.compact
  def __call__(self, carry: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
    x, segment_ids = carry
    y = _norm("ln_1", self.layer_norm_epsilon)(x)
    y = _Attention(self.num_heads, self.head_dim, self.dropout_rate, self.deterministic,
                   name="attn")(y, segment_ids)
    x = nn.with_logical_constraint(x + y, ("batch", "length", "embed"))
    y = _norm("ln_2", self.layer_norm_epsilon)(x)
    y = _Mlp(self.mlp_dim, self.dropout_rate, self.deterministic, name="mlp")(y)
    return nn.with_logical_constraint(x + y, ("batch", "length", "embed")), segment_ids


class _Projection(nn.Module):
  """`x[..., *inputs] -> x[..., *outputs]` with a kernel `[*inputs, *outputs]` and a bias
  `[*outputs]`, both annotated (`names`: the kernel's; the bias takes the output ones)."""

  inputs: tuple[int, ...]
  outputs: tuple[int, ...]
  names: tuple[str | None, ...]

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    n_in = len(self.inputs)
    kernel = self.param("kernel", _param(_init, self.names), (*self.inputs, *self.outputs))
    bias = self.param("bias", _param(nn.initializers.zeros, self.names[n_in:]), self.outputs)
    contract = (tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in)))
    return jax.lax.dot_general(x, kernel, (contract, ((), ()))) + bias


class _Attention(nn.Module):
  num_heads: int
  head_dim: int
  dropout_rate: float
  deterministic: bool

  @nn.compact
  def __call__(self, y: jax.Array, segment_ids: jax.Array) -> jax.Array:
    embed = y.shape[-1]
    heads = (self.num_heads, self.head_dim)
    qkv = _Projection((embed,), (3, *heads), ("embed", None, "heads", "kv"),
                      name="c_attn")(y)
    q, k, v = (nn.with_logical_constraint(qkv[:, :, i], ("batch", "length", "heads", "kv"))
               for i in range(3))
    dropout_rng = None
    if self.dropout_rate > 0 and not self.deterministic:
      dropout_rng = self.make_rng("dropout")
    if kv_cache.current() is not None:  # Decoding: the new tokens over the cache.
      attended = kv_cache.attend(self, q, k, v)
    else:
      attended = attention(q, k, v, segment_ids=segment_ids, dropout_rng=dropout_rng,
                           dropout_rate=self.dropout_rate, deterministic=self.deterministic)
    attended = nn.with_logical_constraint(attended, ("batch", "length", "heads", "kv"))
    out = _Projection(heads, (embed,), ("heads", "kv", "embed"), name="c_proj")(attended)
    return nn.Dropout(self.dropout_rate, deterministic=self.deterministic)(out)


class _Mlp(nn.Module):
  mlp_dim: int
  dropout_rate: float
  deterministic: bool

  @nn.compact
  def __call__(self, y: jax.Array) -> jax.Array:
    embed = y.shape[-1]
    h = nn.Dense(self.mlp_dim, name="c_fc", kernel_init=_param(_init, ("embed", "mlp")),
                 bias_init=_param(nn.initializers.zeros, ("mlp",)))(y)
    h = nn.with_logical_constraint(nn.gelu(h, approximate=True), ("batch", "length", "mlp"))
    out = nn.Dense(embed, name="c_proj", kernel_init=_param(_init, ("mlp", "embed")),
                   bias_init=_param(nn.initializers.zeros, ("embed",)))(h)
    return nn.Dropout(self.dropout_rate, deterministic=self.deterministic)(out)


class GPT2LM(nn.Module):
  """Token ids `[batch, length]` -> next-token logits `[batch, length, vocab]`.

  Attributes:
    vocab_size, max_len: HF's `vocab_size`, `n_positions`.
    num_layers, embed_dim, num_heads: `n_layer`, `n_embd`, `n_head`.
    head_dim: `embed_dim // num_heads` (GPT-2 has no other); None takes it.
    mlp_dim: `n_inner` (HF's default: `4 * n_embd`).
    layer_norm_epsilon: HF's `layer_norm_epsilon`.
    dropout_rate: one rate for the residual, attention and embedding dropout (HF's
      `resid_pdrop`, `attn_pdrop`, `embd_pdrop`), active when `train=True`.
    vocab_multiple: the embedding's rows are `vocab_size` rounded up to a multiple of this
      (`models.vocab`); the padded logits are masked out of the softmax.
  """

  #: The repeated block, by the class name `config.remat.modules` takes (the dry run's advice).
  REMAT_BLOCK = "GPT2Block"

  vocab_size: int
  num_layers: int = 2
  embed_dim: int = 64
  num_heads: int = 4
  head_dim: int | None = None
  mlp_dim: int = 256
  max_len: int = 128
  layer_norm_epsilon: float = 1e-5
  dropout_rate: float = 0.0
  vocab_multiple: int = 1

  @nn.compact
  def __call__(self, tokens: jax.Array, segment_ids: jax.Array | None = None,
               positions: jax.Array | None = None, train: bool = False) -> jax.Array:
    length = tokens.shape[1]
    check_length(length, self.max_len)
    if self.embed_dim % self.num_heads:
      raise ValueError(f"embed_dim={self.embed_dim} must be a multiple of "
                       f"num_heads={self.num_heads}")
    if self.head_dim not in (None, self.embed_dim // self.num_heads):
      raise ValueError(f"config.model.head_dim={self.head_dim}: GPT-2's head width is "
                       f"embed_dim / num_heads = {self.embed_dim // self.num_heads}; leave it "
                       f"None or set that.")
    rows = padded_size(self.vocab_size, self.vocab_multiple)
    embedding = nn.Embed(rows, self.embed_dim, name="token_embedding",
                         embedding_init=_param(_init, ("vocab", "embed")))
    table = self.param("position_embedding", _param(nn.initializers.normal(0.01),
                                                    ("length", "embed")),
                       (self.max_len, self.embed_dim))
    where = sequence_positions(*tokens.shape) if positions is None else positions
    x = embedding(tokens) + jnp.take(table, where, axis=0)
    x = nn.Dropout(self.dropout_rate, deterministic=not train)(x)
    x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
    block = dict(num_heads=self.num_heads, head_dim=self.embed_dim // self.num_heads,
                 mlp_dim=self.mlp_dim, layer_norm_epsilon=self.layer_norm_epsilon,
                 dropout_rate=self.dropout_rate, deterministic=not train)
    x, _ = LayerStack(GPT2Block, self.num_layers, block, name="blocks")((x, segment_ids))
    x = _norm("ln_f", self.layer_norm_epsilon)(x)
    logits = mask_padding(embedding.attend(x), self.vocab_size)
    return nn.with_logical_constraint(logits, ("batch", "length", "vocab"))
