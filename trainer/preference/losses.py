r"""Preference losses, each a function of per-sequence log-probs, and the log-probs themselves.

Notation: for a pair, $\pi_c, \pi_r$ are the policy's summed log-probs of the chosen and
rejected responses' tokens (the prompt's tokens are not counted), $\rho_c, \rho_r$ the
reference's, $n_c, n_r$ the responses' token counts, $\bar\pi = \pi / n$ the
length-normalised log-prob and $\sigma$ the logistic function. Each function returns one
loss per pair; the Trainer averages them over the batch.

- `sigmoid` (DPO): $-\log\sigma(\beta((\pi_c - \rho_c) - (\pi_r - \rho_r)))$.
- `ipo`: $((\pi_c - \rho_c) / n_c - (\pi_r - \rho_r) / n_r - 1 / (2\beta))^2$ (TRL's
  per-token normalisation of the log-ratios).
- `simpo`: $-\log\sigma(\beta(\bar\pi_c - \bar\pi_r) - \gamma)$; no reference.
- `orpo`: $\mathrm{NLL}_c - \lambda \log\sigma(\log\frac{p_c}{1 - p_c} - \log\frac{p_r}{1 -
  p_r})$ with $\log p = \bar\pi$; no reference. $\mathrm{NLL}_c$ is TRL's: the mean
  cross-entropy of every chosen token after the first, the prompt's included, over the
  batch's chosen tokens (`orpo` takes each pair's summed NLL and the batch's count).

The rewards a run logs are $\beta(\pi - \rho)$ for DPO and IPO, and $\beta\bar\pi$ for
SimPO ($\lambda\bar\pi$ for ORPO), as TRL logs them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

#: The losses `config.preference.loss` names.
LOSSES = ("sigmoid", "ipo", "simpo", "orpo")
#: The losses that compare the policy with a reference policy.
WITH_REFERENCE = ("sigmoid", "ipo")


def token_logps(logits: jax.Array, targets: jax.Array, vocab_size: int) -> jax.Array:
  """Each target's log-prob under `logits` `[..., length, vocab]`, over the first
  `vocab_size` columns (a vocabulary padded for the mesh has more): `[..., length]`, in
  float32."""
  logits = logits[..., :vocab_size].astype(jnp.float32)
  picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  return picked - jax.nn.logsumexp(logits, axis=-1)


def sequence_logps(per_token: jax.Array, weights: jax.Array) -> jax.Array:
  """Per-sequence sums of `per_token` log-probs where `weights` is 1 (the response's
  targets): `[...]`."""
  return (per_token * weights).sum(axis=-1)


def sigmoid(chosen, rejected, ref_chosen, ref_rejected, *, beta) -> jax.Array:
  """DPO's loss (Rafailov et al., 2023), TRL's `loss_type="sigmoid"`."""
  return -jax.nn.log_sigmoid(beta * ((chosen - ref_chosen) - (rejected - ref_rejected)))


def ipo(chosen, rejected, ref_chosen, ref_rejected, *, chosen_tokens, rejected_tokens,
        beta) -> jax.Array:
  """IPO's loss (Azar et al., 2023, eq. 17), the log-ratios per response token as TRL's
  `loss_type="ipo"` takes them."""
  delta = ((chosen - ref_chosen) / jnp.maximum(chosen_tokens, 1.0)
           - (rejected - ref_rejected) / jnp.maximum(rejected_tokens, 1.0))
  return (delta - 1.0 / (2.0 * beta)) ** 2


def simpo(chosen_mean, rejected_mean, *, beta, gamma) -> jax.Array:
  """SimPO's loss (Meng et al., 2024) of length-normalised log-probs: TRL's
  `CPOTrainer(loss_type="simpo", cpo_alpha=0)`, `gamma` its `simpo_gamma`."""
  return -jax.nn.log_sigmoid(beta * (chosen_mean - rejected_mean) - gamma)


def log1mexp(x: jax.Array) -> jax.Array:
  """`log(1 - exp(x))` for `x < 0`, without cancellation on either side of `-log 2`."""
  return jnp.where(x < -jnp.log(2.0), jnp.log1p(-jnp.exp(x)), jnp.log(-jnp.expm1(x)))


def log_odds_ratio(chosen_mean, rejected_mean) -> jax.Array:
  """`log(odds(chosen) / odds(rejected))`, the odds of each response's mean log-prob."""
  return (chosen_mean - rejected_mean) - (log1mexp(chosen_mean) - log1mexp(rejected_mean))


def orpo(chosen_mean, rejected_mean, *, chosen_nll, batch_count, lam) -> jax.Array:
  """ORPO's loss (Hong et al., 2024), as TRL's `ORPOTrainer` computes it: the mean over
  the pairs is the batch's token-mean chosen NLL minus `lam` times the mean log-sigmoid
  of the log odds ratio.

  Args:
    chosen_mean, rejected_mean: the responses' length-normalised log-probs.
    chosen_nll: each pair's summed cross-entropy over its chosen sequence's targets.
    batch_count: the chosen targets in the batch (what TRL's token mean divides by).
    lam: the odds-ratio term's weight (TRL's `beta`).
  """
  pairs = chosen_mean.shape[0]
  nll = chosen_nll * pairs / jnp.maximum(batch_count, 1.0)
  return nll - lam * jax.nn.log_sigmoid(log_odds_ratio(chosen_mean, rejected_mean))
