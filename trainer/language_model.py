"""A Trainer for next-token language models, and a synthetic token stream to train them on."""

from __future__ import annotations

import math
from collections.abc import Iterator

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import models
from models import moe
from models.moe import MoeOutput
from trainer import metrics as metrics_lib
from trainer.data import packing
from trainer.trainer import Batch, Trainer


def language_model(family: str = "transformer", **fields):
  """The module `config.model` describes: `models.TransformerLM(**fields)`, or with
  `family='gpt2'`, `'llama'`, `'mistral'`, `'qwen2'`, `'qwen3'`, `'mixtral'` or `'qwen3_moe'`
  the module whose weights are
  that Hugging Face family's (`trainer.interop.families`;
  `trainer.interop.hf.model_fields(path)` reads a published checkpoint's fields).

  A field that is None takes the family's default (`configs/lm.py` declares every
  family's fields so that each layout runs each family by flag).

  Raises:
    ValueError: a field set (not None) that the family's module does not have.
  """
  fields = model_fields(family, **fields)
  if family == "transformer":
    return models.TransformerLM(**{k: v for k, v in fields.items() if k != "family"})
  from trainer.interop import families
  return families.get(family).build(fields)


def model_fields(family: str = "transformer", **fields) -> dict:
  """`config.model`'s fields for `family`'s module, `family` included: the ones set (not
  None), each other field of the module at its default (what an HF export of the model
  writes).

  Raises:
    ValueError: a field set (not None) that the family's module does not have.
  """
  from trainer.interop import families
  return families.module_fields(family, **fields)


class LanguageModelTrainer(Trainer):
  """Next-token cross-entropy; the model is `language_model(**config.model)`.

  Batches hold `inputs` and `targets`, both `[batch, length]` token ids, the
  targets shifted one position left. A packed batch (`trainer.data.packing`) also holds
  `segment_ids` and `positions`, which the model takes: attention stays within each
  document, and the loss averages only the real (not padding) tokens. A batch of
  instruction data holds `loss_weights` (each target's weight: 1 for a response's tokens,
  0 for the prompt's), and each row's loss is the weighted mean. A subclass may override
  `build_model`.
  """

  input_key = "inputs"
  target_key = "targets"

  def build_model(self) -> nn.Module:
    """`language_model(**config.model)` with its vocabulary padded to a multiple of the
    pieces the layout splits `vocab` into (`models.vocab`; `config.model.vocab_multiple`,
    where set, is a multiple too)."""
    fields = self.config.model.to_dict()
    fields["vocab_multiple"] = math.lcm(fields.pop("vocab_multiple", None) or 1,
                                       self.strategy.shards_of("vocab"))
    return language_model(**fields)

  def model_inputs(self, batch: Batch, *, train: bool, rngs) -> tuple[tuple, dict]:
    """The tokens, and a packed batch's `segment_ids` and `positions`."""
    del train, rngs
    packed = {k: batch[k] for k in (packing.SEGMENT_IDS, packing.POSITIONS) if k in batch}
    return (batch[self.input_key],), packed

  def prediction(self, outputs: jax.Array | MoeOutput) -> jax.Array:
    """Next-token probabilities over the real vocabulary (the padded columns dropped)."""
    logits = outputs.logits if isinstance(outputs, MoeOutput) else outputs
    return jax.nn.softmax(logits[..., :self.config.model.vocab_size], axis=-1)

  def loss(self, outputs: jax.Array | MoeOutput, batch: Batch) -> jax.Array:
    """Each example's next-token cross-entropy; a mixture of experts adds its router losses
    (`config.moe`'s weights times `models.moe.summarize`'s), the same to every example."""
    if isinstance(outputs, MoeOutput):
      router = moe.summarize(outputs.router)
      extra = (self.config.moe.load_balance_weight * router["load_balance"]
               + self.config.moe.router_z_weight * router["router_z"])
      return self.loss(outputs.logits, batch) + extra
    per_token = optax.softmax_cross_entropy_with_integer_labels(outputs,
                                                                batch[self.target_key])
    if packing.SEGMENT_IDS not in batch and packing.LOSS_WEIGHTS not in batch:
      return per_token.mean(axis=-1)
    real = jnp.ones_like(per_token)
    if packing.SEGMENT_IDS in batch:
      real = (batch[packing.SEGMENT_IDS] > 0).astype(per_token.dtype)
    if packing.LOSS_WEIGHTS in batch:  # Instruction data: the response's tokens alone.
      real = real * batch[packing.LOSS_WEIGHTS].astype(per_token.dtype)
    return (per_token * real).sum(axis=-1) / jnp.maximum(real.sum(axis=-1), 1.0)

  def train_metrics(self, outputs, batch: Batch, loss: jax.Array):
    """The loss; a mixture of experts' router losses and routing too
    (`trainer.metrics.moe_train_metrics`), where a user sees routing collapse."""
    if not isinstance(outputs, MoeOutput):
      return super().train_metrics(outputs, batch, loss)
    router = moe.summarize(outputs.router)
    share = router["expert_share"]
    values = dict(loss=loss, moe_load_balance=router["load_balance"],
                  moe_router_z=router["router_z"],
                  moe_dropped_fraction=router["dropped_fraction"],
                  moe_max_load=share.max() * share.shape[-1],
                  **{f"moe_expert_{e}_share": share[e] for e in range(share.shape[-1])})
    return metrics_lib.moe_train_metrics(share.shape[-1]).single_from_model_output(**values)

  def eval_metrics(self, outputs, batch: Batch):
    """The eval loss is the cross-entropy alone (a mixture of experts' router losses are a
    training objective, not the model's fit)."""
    return super().eval_metrics(
        outputs.logits if isinstance(outputs, MoeOutput) else outputs, batch)

  def tokens_per_example(self, batch: Batch) -> int:
    """The target tokens of one row; of a packed batch, the real (not padding) ones per row."""
    if packing.SEGMENT_IDS in batch:
      segments = np.asarray(batch[packing.SEGMENT_IDS])
      return max(1, round(float((segments > 0).sum()) / len(segments)))
    return int(np.prod(np.shape(batch[self.target_key])[1:]))


def synthetic_token_batches(seed: int, batch_size: int, length: int, vocab_size: int,
                            start_step: int = 0,
                            rows: slice = slice(None)) -> Iterator[dict[str, np.ndarray]]:
  """Endless batches of arithmetic sequences mod `vocab_size`; batch s depends on (seed, s) only.

  Each sequence starts at a random token and advances by a random stride in
  `[1, vocab_size // 4]`, so the next token is predictable from the context:
  a small model's loss falls well below `log(vocab_size)` within a few hundred
  steps. `rows` picks a process's rows of each batch
  (`trainer.strategy.process_slice(batch_size)`).
  """
  step = start_step
  while True:
    rng = np.random.default_rng((seed, step))
    start = rng.integers(0, vocab_size, size=(batch_size, 1))
    stride = rng.integers(1, max(2, vocab_size // 4 + 1), size=(batch_size, 1))
    tokens = ((start + stride * np.arange(length + 1)) % vocab_size).astype(np.int32)
    tokens = tokens[rows]
    yield {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    step += 1


def example_batch(config) -> dict[str, np.ndarray]:
  """One batch of the shapes an LM config trains on (`config.batch_size` x `config.seq_len`
  tokens): what the dry run (`python -m trainer.plan`) compiles the step for."""
  return next(synthetic_token_batches(config.seed, config.batch_size, config.seq_len,
                                      config.model.vocab_size))
