"""Float tolerances that follow from the computation, not from the machine a test ran on.

Two float32 runs of the same training that differ only in how their sums are
ordered (a batch split over devices and its statistics `pmean`-ed, a gradient
accumulated over microbatches, a program vectorised for AVX2 or for AVX-512)
drift apart by as much as the training trajectory amplifies rounding errors.
That amplification is a property of the model, the data and the number of
steps, not of the CPU: a BatchNorm over a small batch, or a bias whose
gradient is zero in exact arithmetic, can turn one rounding error into a
relative difference of 1e-3 after three steps.

So an equivalence is measured against a chaos reference: the reference run
again from its initial parameters perturbed by +-`CHAOS_SCALE` (relative, about
8 float32 roundings; an antithetic pair, one random sign pattern added and
subtracted). Per leaf, the tolerance is `CHAOS_FACTOR` times the larger of the
two drifts that perturbation causes, plus `FLOOR_ULPS` rounding units of the
largest value in the tree (the rounding of the sums every leaf comes from).

Why a pair: most of the drift is smooth (proportional to the perturbation),
but some is a jump. An activation that lies within rounding of a ReLU's kink
(or of a max-pool tie) takes the other branch in one run and not in the other,
and that example's contribution to a weight's gradient changes by a finite
amount, however small the rounding was. One of the pair moves such an
activation towards the kink by about 8 roundings, so it crosses, and the jump
is in the tolerance; a single perturbation crosses it half the time. A real
difference (a missed gradient mean, statistics over the wrong batch, a wrong
learning rate) is orders of magnitude past it. Measured (issue 18's note): the
NNX MNIST CNN with sync BatchNorm, 3 steps, pmap against one device, compiled
for `--xla_cpu_max_isa=AVX`: 2.0e-5 apart in `conv2/kernel` (one ReLU flip);
the chaos pair drifts 2.0e-5 there too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

#: The relative size of the initial-parameter perturbation: about 8 float32 roundings
#: (eps = 1.19e-7), so that its smooth drift exceeds that of rounding alone.
CHAOS_SCALE = 1e-6
#: How many chaos drifts two orderings of the same float32 computation may differ by.
CHAOS_FACTOR = 4.0
#: The least tolerance, in float32 roundings of the largest value in the compared tree: a
#: sum rounds relative to the largest terms that flow through it, so a leaf whose value is
#: mostly cancellation (a bias whose exact gradient is near zero) is as noisy as those terms,
#: while a perturbation of it (zero at init) may not move it at all.
FLOOR_ULPS = 8


def perturbed(tree, scale: float = CHAOS_SCALE, seed: int = 1234):
  """`tree` with each floating leaf multiplied by `1 ± scale` (a random sign per element),
  placed as the leaf was.

  The signs come from NumPy and the product is taken on the host, in the leaf's dtype (the
  roundings XLA would make), so no program is compiled for it: drawn by `jax.random` and
  multiplied on the devices, each leaf shape compiled programs of its own.
  """
  rng = np.random.default_rng(seed)

  def one(x):
    host = np.asarray(x)
    if not jnp.issubdtype(host.dtype, jnp.floating):  # bfloat16 is one.
      return x
    signs = (2 * rng.integers(0, 2, size=host.shape) - 1).astype(host.dtype)
    out = host * (np.asarray(1, host.dtype) + np.asarray(scale, host.dtype) * signs)
    return jax.device_put(out, x.sharding) if isinstance(x, jax.Array) else out

  return jax.tree.map(one, tree)


def chaos_fits(trainer, batches, *, num_steps: int, view=lambda state: state.params,
               rng=None, **fit_kwargs) -> list:
  """`view(state)` after `trainer.fit` from the trainer's own initial state (from `rng`, if
  given) with its parameters `perturbed` by +`CHAOS_SCALE` and by -`CHAOS_SCALE` (the same
  signs)."""
  out = []
  for scale in (CHAOS_SCALE, -CHAOS_SCALE):
    state = trainer.init_state(batches[0], rng=rng)  # Fresh: fit donates the state it gets.
    start = state.replace(params=perturbed(state.params, scale))
    out.append(view(trainer.fit(batches, num_steps=num_steps, state=start,
                                **fit_kwargs).state))
  return out


def tolerances(reference, chaos: list, *, factor: float = CHAOS_FACTOR) -> list[float]:
  """Per leaf of `reference`: the absolute tolerance its chaos runs (`chaos_fits`) give."""
  eps = float(np.finfo(np.float32).eps)
  wants = [np.asarray(x, np.float64) for x in jax.tree.leaves(reference)]
  floor = FLOOR_ULPS * eps * max((float(np.abs(w).max()) for w in wants if w.size), default=0.0)
  out = []
  for want, *moved in zip(wants, *map(jax.tree.leaves, chaos), strict=True):
    drift = max((float(np.abs(np.asarray(m, np.float64) - want).max()) for m in moved
                 if want.size), default=0.0)
    out.append(factor * drift + floor)
  return out


def assert_equivalent(got, reference, chaos: list, *, factor: float = CHAOS_FACTOR) -> None:
  """Asserts `got` equals `reference` leaf by leaf, within the float32 noise of the
  computation (`tolerances` from the chaos runs `chaos` of the reference)."""
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(reference)]
  limits = tolerances(reference, chaos, factor=factor)
  for path, have, want, limit in zip(paths, jax.tree.leaves(got), jax.tree.leaves(reference),
                                     limits, strict=True):
    have, want = np.asarray(have), np.asarray(want)
    assert have.shape == want.shape, (path, have.shape, want.shape)
    np.testing.assert_allclose(
        have, want, rtol=0, atol=limit,
        err_msg=f"{path}: past {factor:g} x the drift of the chaos runs (initial parameters "
                f"perturbed by +-{CHAOS_SCALE:g}) + {FLOOR_ULPS} ulps")
