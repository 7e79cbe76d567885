"""A vocabulary padded to the mesh: the embedding and the output head carry more rows than
there are tokens, and the extra logits are masked out of the softmax.

Published vocabularies do not always divide a mesh (GPT-2's 50257 is 29 x 1733), and an
array's dimension must divide over the mesh axes that split it. The field pads the
vocabulary to a multiple of that split (nanoGPT trains GPT-2 at 50304, Megatron pads to
a multiple of its tensor-parallel size) and keeps the padded logits out of the softmax,
so the loss, the logits of the real tokens and every gradient equal the unpadded model's:

- `padded_size(vocab_size, multiple)`: the rows the embedding and head are made with;
- `mask_padding(logits, vocab_size)`: the padded logits at the dtype's lowest value, so
  a softmax gives them probability 0 exactly (and their gradients are 0).

`LanguageModelTrainer` passes `vocab_multiple` = the number of pieces the layout splits
the `vocab` axis into (`Strategy.shards_of('vocab')`); the prediction, sampling and an
export (`trainer.interop.hf`) drop the padded columns and rows again.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def padded_size(vocab_size: int, multiple: int = 1) -> int:
  """`vocab_size` rounded up to a multiple of `multiple` (>= 1)."""
  if not isinstance(multiple, int) or multiple < 1:
    raise ValueError(f"config.model.vocab_multiple={multiple!r} must be an integer >= 1.")
  return -(-vocab_size // multiple) * multiple


def mask_padding(logits: jax.Array, vocab_size: int) -> jax.Array:
  """`logits [..., padded]` with the columns from `vocab_size` on at the dtype's lowest
  value (a no-op where nothing is padded)."""
  if logits.shape[-1] == vocab_size:
    return logits
  real = jnp.arange(logits.shape[-1]) < vocab_size
  return jnp.where(real, logits, jnp.finfo(logits.dtype).min)
