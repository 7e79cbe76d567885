r"""GRPO's objective and its variants, as functions of per-token log-probs.

For a prompt's group of $G$ completions with rewards $r_i$, the advantage of completion
$i$ is

$$A_i = \frac{r_i - \mathrm{mean}(r)}{\mathrm{std}(r) + \epsilon_A}$$

with the std of the group with Bessel's correction ($G - 1$ in the denominator) and
$\epsilon_A = 10^{-4}$, as TRL 1.16 computes it (`scale="group"`); Dr. GRPO leaves out the
division (`scale="none"`). A completion without a reward (NaN: every reward function
returned None) is left out of its group's mean and std and gets an advantage of 0, as in
TRL. Each completion token $t$ then has the loss

$$\ell_{i,t} = -\min(\rho_{i,t} A_i,\ \mathrm{clip}(\rho_{i,t}, 1 - \varepsilon,
1 + \varepsilon_{high}) A_i) + \beta\, \rho_{i,t}\, k_3(i, t)$$

with $\rho = \exp(\log\pi - \log\pi_{old})$ and the KL estimate $k_3 = e^{\log\pi_{ref} -
\log\pi} - (\log\pi_{ref} - \log\pi) - 1$, multiplied by $\rho$ (TRL's
`use_bias_correction_kl`, its default). The loss types aggregate the tokens' losses:

- `grpo`: each completion's mean over its tokens, then the mean over completions;
- `dr_grpo`: the sum over every token of the batch over (completions x the completion
  budget, `max_completion_length`);
- `dapo`: the sum over every token of the batch over the batch's completion tokens.

`per_sequence` writes each as one loss per completion whose mean over the batch is that
loss, which is what a `Trainer`'s `loss` hook returns.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

LOSSES = ("grpo", "dr_grpo", "dapo")
SCALES = ("group", "none")
#: TRL's constant under the group's std.
ADVANTAGE_EPS = 1e-4


def group_advantages(rewards: jax.Array, group_size: int, *, scale: str = "group"
                     ) -> jax.Array:
  """`[prompts x group_size]` rewards (a prompt's completions side by side) as advantages.

  Raises:
    ValueError: `group_size` below 2 (a group's std needs two), or an unknown `scale`.
  """
  if group_size < 2:
    raise ValueError(f"group_size={group_size}: a group needs at least 2 completions.")
  if scale not in SCALES:
    raise ValueError(f"scale={scale!r} is not one of {SCALES}.")
  grouped = rewards.reshape(-1, group_size)
  centred = grouped - jnp.nanmean(grouped, axis=1, keepdims=True)
  if scale == "group":
    centred = centred / (jnp.nanstd(grouped, axis=1, ddof=1, keepdims=True) + ADVANTAGE_EPS)
  return jnp.where(jnp.isnan(centred), 0.0, centred).reshape(rewards.shape)


def per_token_loss(logps: jax.Array, old_logps: jax.Array, advantages: jax.Array, *,
                   epsilon: float, epsilon_high: float, ref_logps: jax.Array | None = None,
                   beta: float = 0.0, bias_correction_kl: bool = True) -> jax.Array:
  """Each completion token's clipped objective (and, with `beta`, its KL term):
  `[completions, tokens]` from log-probs of that shape and `[completions]` advantages."""
  ratio = jnp.exp(logps - old_logps)
  clipped = jnp.clip(ratio, 1.0 - epsilon, 1.0 + epsilon_high)
  adv = advantages[:, None]
  loss = -jnp.minimum(ratio * adv, clipped * adv)
  if beta:
    delta = ref_logps - logps
    kl = jnp.exp(delta) - delta - 1.0
    loss = loss + beta * (kl * ratio if bias_correction_kl else kl)
  return loss


def per_sequence(per_token: jax.Array, mask: jax.Array, loss_type: str, *,
                 max_completion_length: int) -> jax.Array:
  """One loss per completion whose mean over the batch is `loss_type`'s aggregate of
  `per_token` over the tokens `mask` keeps."""
  sums = (per_token * mask).sum(axis=-1)
  if loss_type == "grpo":
    return sums / jnp.maximum(mask.sum(axis=-1), 1.0)
  if loss_type == "dr_grpo":
    return sums / max_completion_length
  if loss_type == "dapo":
    return sums * mask.shape[0] / jnp.maximum(mask.sum(), 1.0)
  raise ValueError(f"loss_type={loss_type!r} is not one of {LOSSES}.")
