"""A Trainer for next-token language models, and a synthetic token stream to train them on."""

from __future__ import annotations

from collections.abc import Iterator

import flax.linen as nn
import jax
import numpy as np
import optax

import models
from trainer.trainer import Batch, Trainer


def language_model(family: str = "transformer", **fields):
  """The module `config.model` describes: `models.TransformerLM(**fields)`, or with
  `family='gpt2'` / `'llama'` the module whose weights are that Hugging Face family's
  (`trainer.interop.families`; `trainer.interop.hf.model_fields(path)` reads a published
  checkpoint's fields)."""
  if family == "transformer":
    return models.TransformerLM(**fields)
  from trainer.interop import families
  return families.get(family, field="config.model.family").build(fields)


class LanguageModelTrainer(Trainer):
  """Next-token cross-entropy; the model is `language_model(**config.model)`.

  Batches hold `inputs` and `targets`, both `[batch, length]` token ids, the
  targets shifted one position left. A subclass may override `build_model`.
  """

  input_key = "inputs"
  target_key = "targets"

  def build_model(self) -> nn.Module:
    return language_model(**self.config.model.to_dict())

  def loss(self, logits: jax.Array, batch: Batch) -> jax.Array:
    per_token = optax.softmax_cross_entropy_with_integer_labels(logits, batch[self.target_key])
    return per_token.mean(axis=-1)

  def tokens_per_example(self, batch: Batch) -> int:
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
