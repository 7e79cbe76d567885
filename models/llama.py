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

from models import kv_cache
from models.attention import attention, check_length, sequence_positions
from models.layer_stack import NnxLayerStack
from models.moe import MoeFeedForward, MoeOutput, RouterStats
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


def inverse_frequencies(dim: int, theta: float, scaling: dict | None = None) -> jax.Array:
  """The rope's `dim / 2` inverse frequencies: HF's default rope, or with `scaling` (its
  `rope_type='llama3'` parameters: `factor`, `low_freq_factor`, `high_freq_factor`,
  `original_max_position_embeddings`) Llama 3.1's: long wavelengths divided by `factor`,
  short ones kept, the ones between interpolated."""
  inv_freq = 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
  if not scaling:
    return inv_freq
  factor, low, high = (scaling[k] for k in ("factor", "low_freq_factor", "high_freq_factor"))
  context = scaling["original_max_position_embeddings"]
  wavelen = 2 * jnp.pi / inv_freq
  scaled = jnp.where(wavelen > context / low, inv_freq / factor, inv_freq)
  smooth = (context / wavelen - low) / (high - low)
  smoothed = (1 - smooth) * scaled / factor + smooth * scaled
  medium = (wavelen >= context / high) & (wavelen <= context / low)
  return jnp.where(medium, smoothed, scaled)


def rotary(x: jax.Array, theta: float, scaling: dict | None = None,
           positions: jax.Array | None = None) -> jax.Array:
  """`x [batch, length, heads, head_dim]` rotated by its position (HF's `rotate_half` rope;
  `scaling`: `inverse_frequencies`; `positions [batch, length]`: each token's, by default
  its place in the sequence)."""
  inv_freq = inverse_frequencies(x.shape[-1], theta, scaling)
  if positions is None:
    positions = sequence_positions(*x.shape[:2])
  angles = positions.astype(jnp.float32)[..., None] * inv_freq
  angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
  y = x.astype(jnp.float32)
  return (y * jnp.cos(angles) + rotate_half(y) * jnp.sin(angles)).astype(x.dtype)


class LlamaBlock(nnx.Module):
  """`(x, segment_ids, positions) -> the same`: RMSNorm, grouped-query attention with rotary
  embeddings, RMSNorm, SwiGLU; with `moe` (`models.moe.MoeFeedForward`'s fields) the SwiGLU
  is a mixture of experts and the carry also holds the router's statistics.

  The family's variants: `qkv_bias` (Qwen2's q/k/v biases), `qk_norm` (Qwen3's RMSNorm of
  each query and key head before the rope), `sliding_window` (Mistral's: a token attends to
  itself and the `sliding_window - 1` before it), `rope_scaling` (`inverse_frequencies`).
  """

  def __init__(self, embed: int, num_heads: int, num_kv_heads: int, head_dim: int,
               mlp_dim: int, *, rms_norm_eps: float, rope_theta: float, rngs: nnx.Rngs,
               rope_scaling: dict | None = None, qkv_bias: bool = False,
               qk_norm: bool = False, sliding_window: int | None = None,
               moe: dict | None = None):
    self.num_heads, self.num_kv_heads, self.rope_theta = num_heads, num_kv_heads, rope_theta
    # Static (hashable) items: no arrays, nothing for the state.
    self.rope_scaling = tuple(sorted(dict(rope_scaling).items())) if rope_scaling else None
    self.sliding_window = sliding_window
    self.input_layernorm = _rms_norm(embed, rms_norm_eps, rngs)

    def projection(heads: int, names: tuple[str, ...]) -> nnx.LinearGeneral:
      return nnx.LinearGeneral(embed, (heads, head_dim), use_bias=qkv_bias,
                               kernel_init=_with(("embed", *names)),
                               bias_init=_with(names, nnx.initializers.zeros), rngs=rngs)

    attention = dict(
        q_proj=projection(num_heads, ("heads", "kv")),
        k_proj=projection(num_kv_heads, ("kv_heads", "kv")),
        v_proj=projection(num_kv_heads, ("kv_heads", "kv")),
        o_proj=nnx.LinearGeneral((num_heads, head_dim), embed, axis=(-2, -1), use_bias=False,
                                 kernel_init=_with(("heads", "kv", "embed")), rngs=rngs))
    if qk_norm:
      attention.update(
          q_norm=nnx.RMSNorm(head_dim, epsilon=rms_norm_eps, rngs=rngs,
                             scale_init=_with(("kv",), nnx.initializers.ones)),
          k_norm=nnx.RMSNorm(head_dim, epsilon=rms_norm_eps, rngs=rngs,
                             scale_init=_with(("kv",), nnx.initializers.ones)))
    self.self_attn = nnx.Dict(**attention)
    self.post_attention_layernorm = _rms_norm(embed, rms_norm_eps, rngs)
    if moe:  # Mixtral / Qwen3-MoE: the MLP is a mixture of experts (models.moe).
      self.mlp = MoeFeedForward(embed, rngs=rngs, **moe)
      return
    self.mlp = nnx.Dict(
        gate_proj=nnx.Linear(embed, mlp_dim, use_bias=False,
                             kernel_init=_with(("embed", "mlp")), rngs=rngs),
        up_proj=nnx.Linear(embed, mlp_dim, use_bias=False,
                           kernel_init=_with(("embed", "mlp")), rngs=rngs),
        down_proj=nnx.Linear(mlp_dim, embed, use_bias=False,
                             kernel_init=_with(("mlp", "embed")), rngs=rngs))

  def __call__(self, carry: tuple) -> tuple:
    x, segment_ids, positions, *stats = carry
    attn, mlp = self.self_attn, self.mlp
    y = self.input_layernorm(x)
    q, k = attn["q_proj"](y), attn["k_proj"](y)
    if "q_norm" in attn:  # Qwen3: each head normalised before the rope.
      q, k = attn["q_norm"](q), attn["k_norm"](k)
    scaling = dict(self.rope_scaling) if self.rope_scaling else None
    q, k = (rotary(t, self.rope_theta, scaling, positions) for t in (q, k))
    v = attn["v_proj"](y)
    q = nn.with_logical_constraint(q, ("batch", "length", "heads", "kv"))
    k, v = (nn.with_logical_constraint(t, ("batch", "length", "kv_heads", "kv")) for t in (k, v))
    # Query head h reads key/value head h // (num_heads // num_kv_heads), as HF's repeat_kv.
    cache = getattr(self, "cache", None)  # Decoding (`LlamaLM.init_cache`): over the cache.
    if cache is not None:
      attended = kv_cache.attend_nnx(cache, q, k, v, window=self.sliding_window)
    else:
      attended = attention(q, k, v, segment_ids=segment_ids, window=self.sliding_window)
    attended = nn.with_logical_constraint(attended, ("batch", "length", "heads", "kv"))
    x = nn.with_logical_constraint(x + attn["o_proj"](attended), ("batch", "length", "embed"))
    y = self.post_attention_layernorm(x)
    if isinstance(mlp, MoeFeedForward):
      out, layer_stats = mlp(y)
      x = nn.with_logical_constraint(x + out, ("batch", "length", "embed"))
      return x, segment_ids, positions, stats[0] + layer_stats
    h = nnx.silu(mlp["gate_proj"](y)) * mlp["up_proj"](y)
    h = nn.with_logical_constraint(h, ("batch", "length", "mlp"))
    x = nn.with_logical_constraint(x + mlp["down_proj"](h), ("batch", "length", "embed"))
    return x, segment_ids, positions


class LlamaLM(nnx.Module):
  """Token ids `[batch, length]` -> next-token logits `[batch, length, vocab]`.

  The fields are HF's `LlamaConfig` fields under this project's names: `vocab_size`,
  `num_layers` (`num_hidden_layers`), `embed_dim` (`hidden_size`), `num_heads`
  (`num_attention_heads`), `num_kv_heads` (`num_key_value_heads`), `head_dim` (None:
  `embed_dim // num_heads`),
  `mlp_dim` (`intermediate_size`), `max_len` (`max_position_embeddings`),
  `rms_norm_eps`, `rope_theta`, `tie_word_embeddings`, and the variants of the family
  (`LlamaBlock`): `rope_scaling` (Llama 3.1's), `qkv_bias` (Qwen2), `qk_norm` (Qwen3),
  `sliding_window` (Mistral); a mixture of experts (Mixtral, Qwen3-MoE) with `num_experts`
  > 0: `num_experts_per_tok` (top-k), `moe_mlp_dim` (each expert's width; None: `mlp_dim`),
  `norm_topk_prob` (renormalise the chosen gates) and `capacity_factor` (None: dropless;
  `models.moe`), the output then `MoeOutput(logits, router statistics)`; `vocab_multiple`:
  the embedding's and head's rows are `vocab_size` rounded up to a multiple of it
  (`models.vocab`), the padded logits masked out of the softmax.
  """

  #: The repeated block, by the class name `config.remat.modules` takes (the dry run's advice).
  REMAT_BLOCK = "LlamaBlock"

  def __init__(self, vocab_size: int, num_layers: int = 2, embed_dim: int = 64,
               num_heads: int = 4, num_kv_heads: int = 2, head_dim: int | None = None,
               mlp_dim: int = 128, max_len: int = 128, rms_norm_eps: float = 1e-6,
               rope_theta: float = 10000.0, tie_word_embeddings: bool = False,
               vocab_multiple: int = 1, rope_scaling: dict | None = None,
               qkv_bias: bool = False, qk_norm: bool = False,
               sliding_window: int | None = None, num_experts: int = 0,
               num_experts_per_tok: int = 2, moe_mlp_dim: int | None = None,
               norm_topk_prob: bool = True, capacity_factor: float | None = None, *,
               rngs: nnx.Rngs):
    if num_heads % num_kv_heads:
      raise ValueError(f"num_heads={num_heads} must be a multiple of "
                       f"num_kv_heads={num_kv_heads} (grouped-query attention).")
    head_dim = head_dim or embed_dim // num_heads  # HF's default when config.json has none.
    self.max_len, self.tie_word_embeddings = max_len, tie_word_embeddings
    self.vocab_size, self.num_experts = vocab_size, num_experts
    moe = dict(mlp_dim=moe_mlp_dim or mlp_dim, num_experts=num_experts,
               top_k=num_experts_per_tok, normalize=norm_topk_prob,
               capacity_factor=capacity_factor) if num_experts else None
    rows = padded_size(vocab_size, vocab_multiple)
    self.embed_tokens = nnx.Embed(rows, embed_dim,
                                  embedding_init=_with(("vocab", "embed")), rngs=rngs)
    self.blocks = NnxLayerStack(
        lambda rngs: LlamaBlock(embed_dim, num_heads, num_kv_heads, head_dim, mlp_dim,
                                rms_norm_eps=rms_norm_eps, rope_theta=rope_theta, rngs=rngs,
                                rope_scaling=rope_scaling, qkv_bias=qkv_bias, qk_norm=qk_norm,
                                sliding_window=sliding_window, moe=moe),
        num_layers, rngs=rngs)
    self.norm = _rms_norm(embed_dim, rms_norm_eps, rngs)
    self.lm_head = None if tie_word_embeddings else nnx.Linear(
        embed_dim, rows, use_bias=False, kernel_init=_with(("embed", "vocab")),
        rngs=rngs)

  def init_cache(self, batch: int, length: int, dtype=jnp.float32) -> None:
    """Gives every layer a key/value cache of `length` slots for `batch` rows
    (`models.kv_cache`): from then on a call decodes, each row's new tokens attending to
    the ones before them, and its `positions` should be the rows' cache indices onward."""
    layers = self.blocks.layers
    num_layers, _, kv_heads, head_dim = layers.self_attn["k_proj"].kernel.shape
    layers.cache = nnx.Dict(**kv_cache.cache_variables(
        batch, length, kv_heads, head_dim, dtype=dtype, leading=(num_layers,),
        leading_names=("layer",)))

  def __call__(self, tokens: jax.Array, segment_ids: jax.Array | None = None,
               positions: jax.Array | None = None) -> jax.Array | MoeOutput:
    """Logits of `tokens` (with the router's statistics, `MoeOutput`, for a mixture of
    experts); a packed batch passes `segment_ids` (each token's document, 0: padding) and
    `positions` (each token's place in its document)."""
    check_length(tokens.shape[1], self.max_len)
    if positions is None:
      positions = sequence_positions(*tokens.shape)
    # The table as the step holds it (bfloat16 under mixed precision): nnx.Embed's output
    # takes its `dtype`, float32 unless given, and would run every layer in float32.
    table = self.embed_tokens.embedding[...]
    x = nn.with_logical_constraint(jnp.take(table, tokens, axis=0), ("batch", "length", "embed"))
    carry = (x, segment_ids, positions)
    if self.num_experts:
      carry += (RouterStats.zeros(tokens.shape[0], self.num_experts),)
    x, *_, stats = self.blocks(carry)
    x = self.norm(x)
    logits = jnp.dot(x, table.T) if self.lm_head is None else self.lm_head(x)
    logits = mask_padding(logits, self.vocab_size)
    logits = nn.with_logical_constraint(logits, ("batch", "length", "vocab"))
    return MoeOutput(logits, stats.total()) if self.num_experts else logits
