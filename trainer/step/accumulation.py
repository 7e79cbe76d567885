"""Gradient accumulation: k microbatches inside one compiled train step.

The step's batch is split into `grad_accum_steps = k` microbatches and their
gradients are summed in a `lax.scan`, so for a model without batch statistics
one update is the big-batch update with one microbatch's activations live
(with BatchNorm each microbatch normalises with its own statistics, and the
running statistics are updated once per microbatch, in order). Microbatch j holds examples j, j + k,
j + 2k, ... of the batch a step sees, so under every strategy it takes an
equal part of each data replica's shard and stays sharded like the batch (a
strided split of a contiguous shard never moves data between devices). Set
by `config.grad_accum_steps` and `config.grad_accum_loop`; the recipe's
`Accumulate` transform applies `microbatched` to the gradient function.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections

from trainer.step.stages import GradFn, StepAux, zero_gradient

PyTree = Any

#: How the microbatches run: a `lax.scan` loop, or unrolled into the step.
LOOPS = ("scan", "unroll")


def default_loop(platform: str) -> str:
  """`unroll` on XLA:CPU, where convolutions inside a loop run 10-15x slower
  (`benchmarks/recipe_cost.py`); `scan` elsewhere, which keeps one microbatch's
  activations live at a time."""
  return "unroll" if platform == "cpu" else "scan"


def from_config(config: ml_collections.ConfigDict, *, num_data_replicas: int,
                strategy_name: str) -> tuple[int, str]:
  """`(steps, loop)` from `grad_accum_steps` and `grad_accum_loop`.

  Raises:
    ValueError: the steps do not divide each data replica's share of the
      batch, or the loop is unknown.
  """
  steps = config.grad_accum_steps
  per_replica = config.batch_size // num_data_replicas
  if not isinstance(steps, int) or steps < 1 or per_replica % steps:
    raise ValueError(
        f"config.grad_accum_steps={steps!r} must be a positive integer that divides the "
        f"{per_replica} examples each of the {num_data_replicas} data replica(s) of strategy "
        f"{strategy_name!r} gets (config.batch_size={config.batch_size}): each microbatch "
        f"takes an equal part of every replica's shard.")
  check_loop(config.grad_accum_loop)
  return steps, config.grad_accum_loop or default_loop(jax.default_backend())


def check_loop(loop: str) -> None:
  """Raises unless `config.grad_accum_loop` names a loop, or is '' (the platform's default).

  Raises:
    ValueError: naming the value and the loops.
  """
  if loop and loop not in LOOPS:
    raise ValueError(f"config.grad_accum_loop={loop!r} is not one of {LOOPS} (or '' for "
                     f"the platform's default).")


def microbatched(grad_fn: GradFn, k: int, *, loop: str = "scan",
                 constrain: Callable[..., PyTree] = lambda tree, batch_dim: tree) -> GradFn:
  """`grad_fn` over k microbatches: mean gradients and loss, the model state carried
  through them in order, the microbatches' metrics merged.

  Microbatch j holds rows j, j + k, ... and draws its RNG streams from
  `fold_in(key, j)`. `constrain(tree, batch_dim=1)` keeps the `[k, n / k, ...]`
  microbatches sharded like the batch (`Strategy.constrain_batch`).
  """

  def accumulated(params, model_state, batch, key):
    def accumulate(carry, micro):
      grad_sum, loss_sum, model_state = carry
      microbatch, index = micro
      grads, aux = grad_fn(params, model_state, microbatch, jax.random.fold_in(key, index))
      carry = (jax.tree.map(jnp.add, grad_sum, grads), loss_sum + aux.loss, aux.model_state)
      return carry, aux.metrics

    microbatches = jax.tree.map(
        lambda x: jnp.swapaxes(x.reshape((x.shape[0] // k, k) + x.shape[1:]), 0, 1), batch)
    init = (jax.tree.map(zero_gradient, params), jnp.zeros((), jnp.float32), model_state)
    (grad_sum, loss_sum, model_state), stacked = jax.lax.scan(
        accumulate, init, (constrain(microbatches, batch_dim=1), jnp.arange(k)),
        unroll=k if loop == "unroll" else 1)
    return jax.tree.map(lambda g: g / k, grad_sum), StepAux(loss_sum / k, model_state,
                                                             stacked.reduce())

  return accumulated
