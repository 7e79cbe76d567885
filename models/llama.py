"""A Llama-style decoder (Flax NNX), computing what Hugging Face's `LlamaForCausalLM` computes.

RMSNorm, rotary position embeddings (HF's `rotate_half` convention, so HF's
q/k weights load as they are), SwiGLU MLP, grouped-query attention (`num_kv_heads`
key/value heads shared by `num_heads // num_kv_heads` query heads each). The
weights are HF's in this project's layouts and logical names (the mapping is
`trainer.interop.families.LLAMA`), every one annotated so any strategy, the
pipeline included (the layers are an `NnxLayerStack`), can lay it out:

- `embed_tokens/embedding [vocab, embed]`; `lm_head/kernel [embed, vocab]` unless
  `tie_word_embeddings` (then the head is the embedding's transpose);
- per layer, stacked on `layer`: `self_attn/{q,k,v}_proj/kernel [embed, heads|kv_heads,
  kv]`, `self_attn/o_proj/kernel [heads, kv, embed]`, `mlp/{gate,up}_proj/kernel
  [embed, mlp]`, `mlp/down_proj/kernel [mlp, embed]`, `input_layernorm/scale` and
  `post_attention_layernorm/scale [embed]`;
- `norm/scale`.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from models.layer_stack import NnxLayerStack
from models.vocab import mask_padding, padded_size

_init = nnx.initializers.normal(stddev=0.02)


def _with(names: tuple[str | None, ...], init=_init):
  return nnx.with_partitioning(init, names)


def _rms_norm(dim: int, eps: float, rngs: nnx.Rngs) -> nnx.RMSNorm:
  return nnx.RMSNorm(dim, epsilon=eps, scale_init=_with(("embed",), nnx.initializers.ones),
                     rngs=rngs)


def rotate_half(x: jax.Array) -> jax.Array:
  half = x.shape[-1] // 2
  return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def rotary(x: jax.Array, theta: float) -> jax.Array:
  """`x [batch, length, heads, head_dim]` rotated by its position (HF's default rope)."""
  dim = x.shape[-1]
  inv_freq = 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
  angles = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] * inv_freq[None, :]
  angles = jnp.concatenate([angles, angles], axis=-1)[None, :, None, :]
  y = x.astype(jnp.float32)
  return (y * jnp.cos(angles) + rotate_half(y) * jnp.sin(angles)).astype(x.dtype)


class LlamaBlock(nnx.Module):
  """`x -> x`: RMSNorm, grouped-query attention with rotary embeddings, RMSNorm, SwiGLU."""

  def __init__(self, embed: int, num_heads: int, num_kv_heads: int, head_dim: int,
               mlp_dim: int, *, rms_norm_eps: float, rope_theta: float, rngs: nnx.Rngs):
    self.num_heads, self.num_kv_heads, self.rope_theta = num_heads, num_kv_heads, rope_theta
    self.input_layernorm = _rms_norm(embed, rms_norm_eps, rngs)
    self.self_attn = nnx.Dict(
        q_proj=nnx.LinearGeneral(embed, (num_heads, head_dim), use_bias=False,
                                 kernel_init=_with(("embed", "heads", "kv")), rngs=rngs),
        k_proj=nnx.LinearGeneral(embed, (num_kv_heads, head_dim), use_bias=False,
                                 kernel_init=_with(("embed", "kv_heads", "kv")), rngs=rngs),
        v_proj=nnx.LinearGeneral(embed, (num_kv_heads, head_dim), use_bias=False,
                                 kernel_init=_with(("embed", "kv_heads", "kv")), rngs=rngs),
        o_proj=nnx.LinearGeneral((num_heads, head_dim), embed, axis=(-2, -1), use_bias=False,
                                 kernel_init=_with(("heads", "kv", "embed")), rngs=rngs))
    self.post_attention_layernorm = _rms_norm(embed, rms_norm_eps, rngs)
    self.mlp = nnx.Dict(
        gate_proj=nnx.Linear(embed, mlp_dim, use_bias=False,
                             kernel_init=_with(("embed", "mlp")), rngs=rngs),
        up_proj=nnx.Linear(embed, mlp_dim, use_bias=False,
                           kernel_init=_with(("embed", "mlp")), rngs=rngs),
        down_proj=nnx.Linear(mlp_dim, embed, use_bias=False,
                             kernel_init=_with(("mlp", "embed")), rngs=rngs))

  def __call__(self, x: jax.Array) -> jax.Array:
    attn, mlp = self.self_attn, self.mlp
    y = self.input_layernorm(x)
    q = rotary(attn["q_proj"](y), self.rope_theta)
    k = rotary(attn["k_proj"](y), self.rope_theta)
    v = attn["v_proj"](y)
    q = nn.with_logical_constraint(q, ("batch", "length", "heads", "kv"))
    k, v = (nn.with_logical_constraint(t, ("batch", "length", "kv_heads", "kv")) for t in (k, v))
    # Query head h reads key/value head h // (num_heads // num_kv_heads), as HF's repeat_kv.
    attended = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    attended = nn.with_logical_constraint(attended, ("batch", "length", "heads", "kv"))
    x = nn.with_logical_constraint(x + attn["o_proj"](attended), ("batch", "length", "embed"))
    y = self.post_attention_layernorm(x)
    h = nnx.silu(mlp["gate_proj"](y)) * mlp["up_proj"](y)
    h = nn.with_logical_constraint(h, ("batch", "length", "mlp"))
    return nn.with_logical_constraint(x + mlp["down_proj"](h), ("batch", "length", "embed"))


class LlamaLM(nnx.Module):
  """Token ids `[batch, length]` -> next-token logits `[batch, length, vocab]`.

  The fields are HF's `LlamaConfig` fields under this project's names: `vocab_size`,
  `num_layers` (`num_hidden_layers`), `embed_dim` (`hidden_size`), `num_heads`
  (`num_attention_heads`), `num_kv_heads` (`num_key_value_heads`), `head_dim`,
  `mlp_dim` (`intermediate_size`), `max_len` (`max_position_embeddings`),
  `rms_norm_eps`, `rope_theta`, `tie_word_embeddings`; `vocab_multiple`: the embedding's
  and head's rows are `vocab_size` rounded up to a multiple of it (`models.vocab`), the
  padded logits masked out of the softmax.
  """

  def __init__(self, vocab_size: int, num_layers: int = 2, embed_dim: int = 64,
               num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 16,
               mlp_dim: int = 128, max_len: int = 128, rms_norm_eps: float = 1e-6,
               rope_theta: float = 10000.0, tie_word_embeddings: bool = False,
               vocab_multiple: int = 1, *, rngs: nnx.Rngs):
    if num_heads % num_kv_heads:
      raise ValueError(f"num_heads={num_heads} must be a multiple of "
                       f"num_kv_heads={num_kv_heads} (grouped-query attention).")
    self.max_len, self.tie_word_embeddings = max_len, tie_word_embeddings
    self.vocab_size = vocab_size
    rows = padded_size(vocab_size, vocab_multiple)
    self.embed_tokens = nnx.Embed(rows, embed_dim,
                                  embedding_init=_with(("vocab", "embed")), rngs=rngs)
    self.blocks = NnxLayerStack(
        lambda rngs: LlamaBlock(embed_dim, num_heads, num_kv_heads, head_dim, mlp_dim,
                                rms_norm_eps=rms_norm_eps, rope_theta=rope_theta, rngs=rngs),
        num_layers, rngs=rngs)
    self.norm = _rms_norm(embed_dim, rms_norm_eps, rngs)
    self.lm_head = None if tie_word_embeddings else nnx.Linear(
        embed_dim, rows, use_bias=False, kernel_init=_with(("embed", "vocab")),
        rngs=rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    if tokens.shape[1] > self.max_len:
      raise ValueError(f"sequence length {tokens.shape[1]} exceeds max_len={self.max_len}")
    x = nn.with_logical_constraint(self.embed_tokens(tokens), ("batch", "length", "embed"))
    x = self.norm(self.blocks(x))
    logits = (self.embed_tokens.attend(x) if self.lm_head is None else self.lm_head(x))
    logits = mask_padding(logits, self.vocab_size)
    return nn.with_logical_constraint(logits, ("batch", "length", "vocab"))
