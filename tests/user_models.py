"""Models written the way the Flax examples write them, as a researcher brings them.

None of them knows about strategies: they use Flax's own conventions only
(`train` / `deterministic`, `axis_name='batch'`, a `config` dataclass, two
inputs, an RNG argument, NNX modules), and the tests train them through the
Trainer's hooks alone.
"""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import models
from trainer import ClassificationTrainer, Trainer

# -- A wmt-style encoder-decoder: two inputs, dropout, `deterministic` in its config ------------


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Hyperparameters, as the Flax lm1b/wmt examples keep them (`deterministic` included)."""

  vocab_size: int = 12
  emb_dim: int = 16
  num_heads: int = 2
  mlp_dim: int = 32
  dropout_rate: float = 0.2
  deterministic: bool = False


class EncoderDecoder(nn.Module):
  """One encoder and one decoder layer; `__call__(inputs, targets)` gives target logits."""

  config: TransformerConfig

  @nn.compact
  def __call__(self, inputs: jax.Array, targets: jax.Array) -> jax.Array:
    cfg = self.config
    embed = nn.Embed(cfg.vocab_size, cfg.emb_dim, name="embed")
    dropout = lambda x: nn.Dropout(cfg.dropout_rate)(x, deterministic=cfg.deterministic)  # noqa: E731
    attention = functools.partial(nn.MultiHeadDotProductAttention, num_heads=cfg.num_heads,
                                  dropout_rate=cfg.dropout_rate,
                                  deterministic=cfg.deterministic)
    x = dropout(embed(inputs))
    encoded = nn.LayerNorm()(x + attention(name="encoder")(x, x))
    shifted = jnp.pad(targets, ((0, 0), (1, 0)))[:, :-1]
    y = dropout(embed(shifted))
    causal = nn.make_causal_mask(shifted)
    y = nn.LayerNorm()(y + attention(name="self")(y, y, mask=causal))
    y = nn.LayerNorm()(y + attention(name="cross")(y, encoded))
    h = dropout(nn.relu(nn.Dense(cfg.mlp_dim)(y)))
    y = nn.LayerNorm()(y + nn.Dense(cfg.emb_dim)(h))
    return embed.attend(y)


class EncoderDecoderTrainer(Trainer):
  """Token cross-entropy of `EncoderDecoder` on `inputs` -> `targets` (wmt's batch keys)."""

  def build_model(self):
    return EncoderDecoder(TransformerConfig(dropout_rate=self.config.get("dropout_rate", 0.2)))

  def model_inputs(self, batch, *, train, rngs):
    return (batch["inputs"], batch["targets"]), {}

  def loss(self, logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean(-1)


def copy_batches(num: int, batch_size: int, length: int = 6, vocab: int = 12, seed: int = 0):
  """Token sequences whose targets are the inputs reversed."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(num):
    inputs = rng.integers(1, vocab, size=(batch_size, length)).astype(np.int32)
    out.append({"inputs": inputs, "targets": inputs[:, ::-1].copy()})
  return out


# -- ResNet with BatchNorm (Flax ImageNet style), and variants -------------------------------


class ResNetTrainer(ClassificationTrainer):
  def build_model(self):
    return models.ResNet(stage_sizes=(1, 1), num_filters=4, num_classes=10)


class LocalBatchNorm(nn.Module):
  """BatchNorm without `axis_name`: its statistics are those of the batch the call sees."""

  axis_name: str | None = None

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = x.reshape((x.shape[0], -1))
    x = nn.Dense(8)(x)
    x = nn.BatchNorm(use_running_average=not train, axis_name=self.axis_name)(x)
    return nn.Dense(10)(x)


# -- A model with an RNG argument (the Flax VAE example's `z_rng`) and one with its own stream ---


class NoisyClassifier(nn.Module):
  """Adds Gaussian noise from the `noise` stream in training; takes an explicit `z_rng`."""

  @nn.compact
  def __call__(self, x, z_rng, train: bool = True):
    x = x.reshape((x.shape[0], -1))
    h = nn.Dense(16)(x)
    if train:
      h = h + 0.1 * jax.random.normal(self.make_rng("noise"), h.shape)
    h = h + 0.01 * jax.random.normal(z_rng, h.shape)
    return nn.Dense(10)(nn.relu(h))


class NoisyTrainer(ClassificationTrainer):
  rng_streams = ("dropout", "noise", "z")

  def build_model(self):
    return NoisyClassifier()

  def model_inputs(self, batch, *, train, rngs):
    return (batch["image"], rngs["z"]), {}


# -- NNX ------------------------------------------------------------------------------------


class NnxCNNTrainer(ClassificationTrainer):
  def build_model(self):
    return models.nnx_models.CNN


class NnxMLPTrainer(Trainer):
  def build_model(self):
    m = self.config.model
    return functools.partial(models.nnx_models.MLP, m.embed, m.depth, m.num_layers)

  def loss(self, outputs, batch):
    return models.nnx_models.mean_squared_error(outputs, batch["targets"])


class NnxBatchNormDropout(nnx.Module):
  """An NNX classifier with BatchNorm (`axis_name='batch'`) and Dropout."""

  def __init__(self, dropout_rate: float = 0.0, *, rngs: nnx.Rngs):
    self.dense = nnx.Linear(28 * 28, 16, rngs=rngs)
    self.norm = nnx.BatchNorm(16, axis_name="batch", rngs=rngs)
    self.dropout = nnx.Dropout(dropout_rate, rngs=rngs)
    self.out = nnx.Linear(16, 10, rngs=rngs)

  def __call__(self, x):
    x = x.reshape((x.shape[0], -1))
    return self.out(self.dropout(nnx.relu(self.norm(self.dense(x)))))


class NnxBatchNormTrainer(ClassificationTrainer):
  def build_model(self):
    return functools.partial(NnxBatchNormDropout, self.config.get("dropout_rate", 0.0))


class FlaxNnxMnistCNN(nnx.Module):
  """Flax's NNX MNIST example CNN as that example writes it: `BatchNorm` without
  `axis_name`, `Dropout` without its own `rngs`, and `rngs` as a `__call__` argument."""

  def __init__(self, *, rngs: nnx.Rngs):
    self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), rngs=rngs)
    self.batch_norm1 = nnx.BatchNorm(32, rngs=rngs)
    self.dropout1 = nnx.Dropout(rate=0.025)
    self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
    self.batch_norm2 = nnx.BatchNorm(64, rngs=rngs)
    self.avg_pool = functools.partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
    self.linear1 = nnx.Linear(3136, 256, rngs=rngs)
    self.dropout2 = nnx.Dropout(rate=0.025)
    self.linear2 = nnx.Linear(256, 10, rngs=rngs)

  def __call__(self, x, rngs: nnx.Rngs | None = None):
    x = self.avg_pool(nnx.relu(self.batch_norm1(self.dropout1(self.conv1(x), rngs=rngs))))
    x = self.avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))))
    x = x.reshape(x.shape[0], -1)
    x = nnx.relu(self.dropout2(self.linear1(x), rngs=rngs))
    return self.linear2(x)


class FlaxNnxMnistTrainer(ClassificationTrainer):
  def build_model(self):
    return FlaxNnxMnistCNN


# -- The Flax examples' way in few lines: BatchNorm over `batch`, dropout by `train` -----------


class FlaxStyleNet(nn.Module):
  """BatchNorm over the `batch` axis and dropout by `train`, as the Flax examples write them."""

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Dense(16)(x.reshape((x.shape[0], -1)))
    x = nn.BatchNorm(use_running_average=not train, axis_name="batch")(x)
    x = nn.Dropout(0.2, deterministic=not train)(nn.relu(x))
    return nn.Dense(10)(x)


class FlaxStyleTrainer(ClassificationTrainer):
  def build_model(self):
    return FlaxStyleNet()



# -- A decoder written the way Flax's current NNX examples write one (explicit sharding) -------


def explicit_sharding(spec: jax.sharding.PartitionSpec) -> jax.sharding.PartitionSpec | None:
  """`spec` under a mesh with Explicit axes (where jax asks the model for the sharding of an
  ambiguous result, as Flax's NNX examples pass `out_sharding`), else None."""
  mesh = jax.sharding.get_abstract_mesh()
  explicit = not mesh.empty and jax.sharding.AxisType.Explicit in mesh.axis_types
  return spec if explicit else None


class MiniGptBlock(nnx.Module):
  """Pre-norm attention and MLP; each weight carries its mesh `PartitionSpec`."""

  def __init__(self, embed: int, heads: int, mlp: int, *, rngs: nnx.Rngs):
    P = jax.sharding.PartitionSpec  # noqa: N806
    init = nnx.initializers.xavier_uniform()
    self.norm1 = nnx.LayerNorm(embed, scale_init=nnx.with_partitioning(
        nnx.initializers.ones_init(), P("model")), rngs=rngs)
    self.attention = nnx.MultiHeadAttention(
        num_heads=heads, in_features=embed, decode=False,
        kernel_init=nnx.with_partitioning(init, P(None, "model")),
        bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), P("model")), rngs=rngs)
    self.norm2 = nnx.LayerNorm(embed, scale_init=nnx.with_partitioning(
        nnx.initializers.ones_init(), P("model")), rngs=rngs)
    self.up = nnx.Linear(embed, mlp, kernel_init=nnx.with_partitioning(init, P(None, "model")),
                         bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(),
                                                         P("model")), rngs=rngs)
    self.down = nnx.Linear(mlp, embed, kernel_init=nnx.with_partitioning(init, P("model", None)),
                           rngs=rngs)

  def __call__(self, x):
    # The residual stream is split over the batch only; where a contraction runs over a
    # dimension split over 'model', the result's sharding is stated (Megatron's layout).
    stream = explicit_sharding(jax.sharding.PartitionSpec("data", None, None))
    mask = nnx.make_causal_mask(jnp.ones(x.shape[:2]))
    x = x + self.attention(self.norm1(x), mask=mask, out_sharding=stream)
    return x + self.down(nnx.gelu(self.up(self.norm2(x))), out_sharding=stream)


class MiniGpt(nnx.Module):
  """Token and position embeddings, `layers` blocks, a vocabulary head (no rule table)."""

  def __init__(self, vocab: int = 32, embed: int = 16, heads: int = 4, mlp: int = 32,
               layers: int = 2, max_len: int = 16, *, rngs: nnx.Rngs):
    P = jax.sharding.PartitionSpec  # noqa: N806
    normal = nnx.initializers.normal(0.02)
    self.tokens = nnx.Embed(vocab, embed, embedding_init=nnx.with_partitioning(
        normal, P(None, "model")), rngs=rngs)
    self.positions = nnx.Embed(max_len, embed, embedding_init=nnx.with_partitioning(
        normal, P(None, "model")), rngs=rngs)
    self.blocks = nnx.List([MiniGptBlock(embed, heads, mlp, rngs=rngs) for _ in range(layers)])
    self.head = nnx.Linear(embed, vocab, use_bias=False, kernel_init=nnx.with_partitioning(
        nnx.initializers.xavier_uniform(), P(None, "model")), rngs=rngs)

  def __call__(self, tokens):
    P = jax.sharding.PartitionSpec  # noqa: N806
    x = self.tokens(tokens, out_sharding=explicit_sharding(P("data", None, None)))
    x = x + self.positions(jnp.arange(tokens.shape[1]),
                           out_sharding=explicit_sharding(P(None, None)))[None]
    for block in self.blocks:
      x = block(x)
    return self.head(x, out_sharding=explicit_sharding(P("data", None, None)))


class MiniGptTrainer(Trainer):
  input_key, target_key = "inputs", "targets"

  def build_model(self):
    return MiniGpt

  def loss(self, logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean(-1)


# -- A decoder whose blocks are one NNX layer stack (Flax's NNX "scan over layers") -------------


class StackedBlock(nnx.Module):
  """Pre-norm attention (`nnx.Einsum` projections, as Flax's Gemma example writes them) and
  an MLP, with dropout; weights named by logical axes."""

  def __init__(self, embed: int, heads: int, mlp: int, dropout: float, *, rngs: nnx.Rngs):
    init = nnx.initializers.xavier_uniform()
    head_dim = embed // heads

    def project(spec, shape, names):
      return nnx.Einsum(spec, shape, kernel_init=nnx.with_partitioning(init, names), rngs=rngs)

    self.norm1 = nnx.LayerNorm(embed, rngs=rngs)
    self.query, self.key, self.value = (
        project("BTD,DNH->BTNH", (embed, heads, head_dim), ("embed", "heads", "kv"))
        for _ in range(3))
    self.out = project("BTNH,NHD->BTD", (heads, head_dim, embed), ("heads", "kv", "embed"))
    self.norm2 = nnx.LayerNorm(embed, rngs=rngs)
    self.up = nnx.Linear(embed, mlp, kernel_init=nnx.with_partitioning(init, ("embed", "mlp")),
                         rngs=rngs)
    self.down = nnx.Linear(mlp, embed, kernel_init=nnx.with_partitioning(init, ("mlp", "embed")),
                           rngs=rngs)
    self.dropout = nnx.Dropout(dropout, rngs=rngs)

  def __call__(self, x):
    y = self.norm1(x)
    mask = nnx.make_causal_mask(jnp.ones(x.shape[:2]))
    attended = nnx.dot_product_attention(self.query(y), self.key(y), self.value(y), mask=mask)
    x = x + self.dropout(self.out(attended))
    return x + self.dropout(self.down(nnx.gelu(self.up(self.norm2(x)))))


class StackedDecoder(nnx.Module):
  """Embeddings, an `NnxLayerStack` of `StackedBlock`s, a final norm and a vocabulary head."""

  def __init__(self, vocab: int = 32, embed: int = 16, heads: int = 4, mlp: int = 32,
               layers: int = 4, max_len: int = 16, dropout: float = 0.0, *, rngs: nnx.Rngs):
    normal = nnx.initializers.normal(0.02)
    self.tokens = nnx.Embed(vocab, embed, embedding_init=nnx.with_partitioning(
        normal, ("vocab", "embed")), rngs=rngs)
    self.positions = nnx.Param(normal(rngs.params(), (max_len, embed)))
    self.blocks = models.NnxLayerStack(
        lambda rngs: StackedBlock(embed, heads, mlp, dropout, rngs=rngs), layers, rngs=rngs)
    self.norm = nnx.LayerNorm(embed, rngs=rngs)
    self.head = nnx.Linear(embed, vocab, use_bias=False, kernel_init=nnx.with_partitioning(
        nnx.initializers.xavier_uniform(), ("embed", "vocab")), rngs=rngs)

  def __call__(self, tokens):
    x = self.tokens(tokens) + self.positions[: tokens.shape[1]][None]
    return self.head(self.norm(self.blocks(x)))


class StackedDecoderTrainer(Trainer):
  input_key, target_key = "inputs", "targets"
  rng_streams = ("dropout",)
  dropout = 0.0

  def build_model(self):
    return functools.partial(StackedDecoder, dropout=self.dropout)

  def loss(self, logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean(-1)


# -- The same decoder, its attention through the shared function (context parallelism) ---------


class SharedAttentionBlock(StackedBlock):
  """`StackedBlock` with its attention through `models.attention.attention` (what a model
  under a `context` mesh axis must call), with dropout on the attention weights too."""

  def __init__(self, embed: int, heads: int, mlp: int, dropout: float, *, rngs: nnx.Rngs):
    super().__init__(embed, heads, mlp, dropout, rngs=rngs)
    self.rate, self.deterministic = dropout, False
    self.attention_rngs = rngs["dropout"].fork()

  def __call__(self, x):
    y = self.norm1(x)
    key = self.attention_rngs() if self.rate and not self.deterministic else None
    attended = models.attention.attention(
        self.query(y), self.key(y), self.value(y), dropout_rate=self.rate, dropout_rng=key,
        deterministic=self.deterministic)
    x = x + self.dropout(self.out(attended))
    return x + self.dropout(self.down(nnx.gelu(self.up(self.norm2(x)))))


class SharedAttentionDecoder(StackedDecoder):
  """`StackedDecoder` of `SharedAttentionBlock`s; its learned positions are each token's
  place in the sequence (`models.attention.sequence_positions`)."""

  def __init__(self, vocab: int = 32, embed: int = 16, heads: int = 4, mlp: int = 32,
               layers: int = 2, max_len: int = 16, dropout: float = 0.0, *, rngs: nnx.Rngs):
    super().__init__(vocab, embed, heads, mlp, layers, max_len, dropout, rngs=rngs)
    self.blocks = models.NnxLayerStack(
        lambda rngs: SharedAttentionBlock(embed, heads, mlp, dropout, rngs=rngs), layers,
        rngs=rngs)

  def __call__(self, tokens):
    where = models.attention.sequence_positions(*tokens.shape)
    x = self.tokens(tokens) + jnp.take(self.positions[...], where, axis=0)
    return self.head(self.norm(self.blocks(x)))


class SharedAttentionDecoderTrainer(StackedDecoderTrainer):
  def build_model(self):
    return functools.partial(SharedAttentionDecoder, dropout=self.dropout)


# -- A user's NNX decoder whose MLPs are mixtures of experts (expert parallelism) -------------


class ExpertBlock(nnx.Module):
  """Pre-norm causal attention (Flax's own) and dropout, its MLP a mixture of experts
  (`models.moe.MoeFeedForward`): `(x, router statistics) -> the same`."""

  def __init__(self, embed: int, heads: int, mlp: int, experts: int, dropout: float, *,
               rngs: nnx.Rngs):
    init = nnx.initializers.xavier_uniform()

    def project(spec, shape, names):
      return nnx.Einsum(spec, shape, kernel_init=nnx.with_partitioning(init, names), rngs=rngs)

    head_dim = embed // heads
    self.norm1, self.norm2 = nnx.LayerNorm(embed, rngs=rngs), nnx.LayerNorm(embed, rngs=rngs)
    self.query, self.key, self.value = (
        project("BTD,DNH->BTNH", (embed, heads, head_dim), ("embed", "heads", "kv"))
        for _ in range(3))
    self.out = project("BTNH,NHD->BTD", (heads, head_dim, embed), ("heads", "kv", "embed"))
    self.experts = models.moe.MoeFeedForward(embed, mlp, experts, top_k=2, rngs=rngs)
    self.dropout = nnx.Dropout(dropout, rngs=rngs)

  def __call__(self, carry):
    x, stats = carry
    y = self.norm1(x)
    mask = nnx.make_causal_mask(jnp.ones(x.shape[:2]))
    attended = nnx.dot_product_attention(self.query(y), self.key(y), self.value(y), mask=mask)
    x = x + self.dropout(self.out(attended))
    out, layer_stats = self.experts(self.norm2(x))
    return x + self.dropout(out), stats + layer_stats


class ExpertDecoder(StackedDecoder):
  """`StackedDecoder` of `ExpertBlock`s; returns `models.moe.MoeOutput`."""

  def __init__(self, vocab: int = 32, embed: int = 16, heads: int = 4, mlp: int = 32,
               layers: int = 2, max_len: int = 16, dropout: float = 0.0, experts: int = 8, *,
               rngs: nnx.Rngs):
    super().__init__(vocab, embed, heads, mlp, layers, max_len, dropout, rngs=rngs)
    self.num_experts = experts
    self.blocks = models.NnxLayerStack(
        lambda rngs: ExpertBlock(embed, heads, mlp, experts, dropout, rngs=rngs), layers,
        rngs=rngs)

  def __call__(self, tokens):
    x = self.tokens(tokens) + self.positions[: tokens.shape[1]][None]
    x, stats = self.blocks((x, models.moe.RouterStats.zeros(tokens.shape[0],
                                                            self.num_experts)))
    return models.moe.MoeOutput(self.head(self.norm(x)), stats.total())


class ExpertDecoderTrainer(StackedDecoderTrainer):
  """Its own loss: the cross-entropy plus 0.01 x the load-balancing loss."""

  dropout = 0.1

  def build_model(self):
    return functools.partial(ExpertDecoder, dropout=self.dropout)

  def loss(self, outputs, batch):
    balance = models.moe.summarize(outputs.router)["load_balance"]
    return super().loss(outputs.logits, batch) + 0.01 * balance

  def prediction(self, outputs):
    return jax.nn.softmax(outputs.logits, axis=-1)
