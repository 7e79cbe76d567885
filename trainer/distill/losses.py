"""Distillation's divergence between the student's and the teacher's next-token
distributions, per token, over the whole vocabulary (TRL 1.16's `DistillationTrainer`).

Both distributions are taken at the temperature T: `log p = log_softmax(logits / T)`. With
`beta` the divergence is

- `beta = 0`: the forward KL, `KL(p_t || p_s) = sum_v p_t (log p_t - log p_s)`;
- `beta = 1`: the reverse KL, `KL(p_s || p_t)`;
- otherwise the generalized Jensen-Shannon divergence
  `beta KL(p_t || m) + (1 - beta) KL(p_s || m)`, `m = (1 - beta) p_s + beta p_t`.

There is no T² factor. The batch's loss is the sum over completion tokens divided by the
batch's completion tokens (`per_sequence` spreads it over rows so that their mean is it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def log_probs(logits: jax.Array, temperature: float, vocab_size: int | None = None
              ) -> jax.Array:
  """`log_softmax(logits / T)` in float32 over the real vocabulary (a padded embedding's
  extra rows left out)."""
  if vocab_size is not None:
    logits = logits[..., :vocab_size]
  return jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)


def _kl(log_p: jax.Array, log_q: jax.Array) -> jax.Array:
  return (jnp.exp(log_p) * (log_p - log_q)).sum(-1)


def divergence(student: jax.Array, teacher: jax.Array, beta: float | jax.Array
               ) -> jax.Array:
  """Each token's divergence `[..., ]` from both models' log-probs `[..., vocab]`
  (`log_probs`). `beta` may be an array (a sweep's, per member; broadcast against the
  tokens): the three forms are then chosen by `jnp.where`, which keeps each exact at 0
  and 1."""
  forward, reverse = _kl(teacher, student), _kl(student, teacher)
  if isinstance(beta, int | float):
    if beta == 0:
      return forward
    if beta == 1:
      return reverse
  beta = jnp.asarray(beta, jnp.float32)  # A scalar, or one per row broadcast to tokens.
  b = jnp.clip(beta, 1e-12, 1 - 1e-12)[..., None]  # Logs of 0 stay finite.
  mixture = jnp.logaddexp(student + jnp.log1p(-b), teacher + jnp.log(b))
  jsd = b[..., 0] * _kl(teacher, mixture) + (1 - b[..., 0]) * _kl(student, mixture)
  return jnp.where(beta == 0, forward, jnp.where(beta == 1, reverse, jsd))


def entropy(log_p: jax.Array) -> jax.Array:
  """Each token's entropy (nats) of `log_p` `[..., vocab]`."""
  return -(jnp.exp(log_p) * log_p).sum(-1)


def per_sequence(per_token: jax.Array, mask: jax.Array, count: jax.Array | None = None
                 ) -> jax.Array:
  """One value per row whose mean over the rows is the sum of `per_token` over the tokens
  `mask` keeps divided by their count (TRL's reduction); `count`: the count to divide by
  (None: `mask`'s)."""
  count = mask.sum() if count is None else count
  return (per_token * mask).sum(-1) * mask.shape[0] / jnp.maximum(count, 1.0)
