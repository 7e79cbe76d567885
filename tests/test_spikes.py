"""Loss spikes (`config.spikes`): an update whose loss is far above the recent median is left
out, on the device, per member, the same under every strategy and across a resume."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ALL_STRATEGIES, MLPTrainer, leaves, mlp_config, vector_batches
from flax import struct
from test_recipe import recorder

from strategies import member_rng
from trainer.checkpoint import Checkpointer
from trainer.step.spikes import SkipSpikes, SpikeHistory
from trainer.step.stages import StepAux

STEPS, SPIKE = 8, 5  # The batch of step 6 (index 5) has targets 50x too large.
GUARD = {"spikes.skip": True, "spikes.window": 8, "spikes.warmup": 3, "num_train_steps": STEPS}


def _batches():
  batches = vector_batches(STEPS, 16, 8)
  batches[SPIKE] = dict(batches[SPIKE], targets=batches[SPIKE]["targets"] * 50)
  return batches


def _fit(overrides, num_steps=STEPS, state=None, **kwargs):
  trainer = MLPTrainer(mlp_config(**{**GUARD, **overrides}))
  batches = _batches()
  result = trainer.fit(lambda start: batches[start:], num_steps=num_steps, state=state, **kwargs)
  return trainer, result.state


def test_a_spike_is_left_out_and_counted_and_the_run_goes_on():
  batches = _batches()
  trainer = MLPTrainer(mlp_config(**GUARD))
  before = trainer.fit(lambda s: batches[s:], num_steps=SPIKE).state
  params_before = leaves(before.params)
  writer = recorder()
  after = trainer.fit(lambda s: batches[s:], num_steps=STEPS, state=before, writer=writer).state
  assert int(after.step) == STEPS and int(after.spikes.skips) == 1
  assert int(after.spikes.count) == STEPS - 1  # Every accepted loss recorded, not the spike.
  assert not all(np.array_equal(a, b)
                 for a, b in zip(params_before, leaves(after.params), strict=True))
  assert writer.rows[STEPS]["train/spike_skips"] == 1

  unguarded = MLPTrainer(mlp_config(**{**GUARD, "spikes.skip": False}))
  plain = unguarded.fit(lambda s: batches[s:], num_steps=SPIKE + 1).state
  assert plain.spikes is None
  # Without the guard the spike's update is applied.
  assert not np.array_equal(leaves(plain.params)[0], params_before[0])


def test_the_spike_step_keeps_the_state_exactly():
  trainer, before = _fit({}, num_steps=SPIKE)
  host_before = jax.tree.map(np.asarray, (before.params, before.opt_state))
  _, after = _fit({}, num_steps=SPIKE + 1, state=before)
  for a, b in zip(jax.tree.leaves(host_before), leaves((after.params, after.opt_state)),
                  strict=True):
    np.testing.assert_array_equal(a, b)
  assert int(after.step) == SPIKE + 1 and int(after.spikes.skips) == 1


def test_each_member_decides_for_itself():
  """Two members stacked as an ensemble holds them: one sees a spike, the other does not."""
  guard = SkipSpikes(factor=3.0, window=4, warmup=2)

  def update(state, grads, aux, finite):
    return state.replace(params=state.params - grads)

  @struct.dataclass
  class Tiny:  # The smallest state the guard needs: params, step, spikes, replace.
    params: jax.Array
    step: jax.Array
    spikes: SpikeHistory

    def replace(self, **kw):
      return Tiny(**{**{"params": self.params, "step": self.step, "spikes": self.spikes}, **kw})

  history = SpikeHistory(losses=jnp.array([1.0, 1.0, jnp.nan, jnp.nan]), count=jnp.array(2),
                         skips=jnp.array(0))
  states = jax.tree.map(lambda x: jnp.stack([x, x]),
                        Tiny(jnp.ones(3), jnp.array(0), history))
  losses = jnp.array([1.1, 30.0])  # Member 1 spikes.
  guarded = guard.update(update)
  new = jax.vmap(lambda s, loss: guarded(s, jnp.full(3, 0.5), StepAux(loss, None, None),
                                         jnp.array(True)))(states, losses)
  np.testing.assert_array_equal(new.params[0], np.full(3, 0.5))  # Updated.
  np.testing.assert_array_equal(new.params[1], np.ones(3))  # Kept.
  np.testing.assert_array_equal(new.spikes.skips, [0, 1])
  np.testing.assert_array_equal(new.spikes.count, [3, 2])
  np.testing.assert_array_equal(new.step, [0, 0])


@functools.cache
def _single_member_runs(num_members):
  trainer = MLPTrainer(mlp_config(**GUARD))
  batches = _batches()
  base = jax.random.PRNGKey(trainer.config.seed)
  runs = []
  for i in range(num_members):
    state = trainer.init_state(batches[0], rng=member_rng(base, i))
    state = trainer.fit(lambda s: batches[s:], num_steps=STEPS, state=state).state
    runs.append(trainer.strategy.to_canonical((state.params, state.spikes)))
  return runs


@pytest.mark.parametrize("name", [*ALL_STRATEGIES, "sharded_ensemble_3_steps_a_call"])
def test_every_strategy_skips_what_the_single_device_run_skips(name):
  overrides = dict(ALL_STRATEGIES.get(name, ALL_STRATEGIES["sharded_ensemble"]))
  if name.endswith("a_call"):
    overrides["steps_per_call"] = 3
  trainer, state = _fit(overrides)
  params, spikes = trainer.strategy.to_canonical((state.params, state.spikes))
  if "ensemble" in name:
    runs = _single_member_runs(trainer.strategy.num_members)
    for i, (want_params, want_spikes) in enumerate(runs):
      np.testing.assert_array_equal(spikes.skips[i], want_spikes.skips)
      for got, want in zip(leaves(params), leaves(want_params), strict=True):
        np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-6)
    assert (spikes.skips == 1).all()
  else:
    want_params, want_spikes = _reference()
    assert int(spikes.skips) == int(want_spikes.skips) == 1
    for got, want in zip(leaves(params), leaves(want_params), strict=True):
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@functools.cache
def _reference():
  trainer, state = _fit({})
  return trainer.strategy.to_canonical((state.params, state.spikes))


def test_a_resumed_run_skips_exactly_what_an_uninterrupted_one_does(tmp_path):
  """The history is checkpointed per member: stopped before the spike and resumed by a new
  Trainer, a sharded ensemble ends bit for bit where the uninterrupted run ends."""
  overrides = ALL_STRATEGIES["sharded_ensemble"]
  trainer, straight = _fit(overrides)
  straight = trainer.strategy.to_canonical(straight)
  ckpt = Checkpointer(tmp_path / "ckpt", every_steps=4)
  _fit(overrides, num_steps=4, checkpointer=ckpt)
  trainer, resumed = _fit(overrides, checkpointer=ckpt)
  ckpt.close()
  resumed = trainer.strategy.to_canonical(resumed)
  np.testing.assert_array_equal(resumed.spikes.skips, [1, 1, 1, 1])
  for a, b in zip(leaves(resumed), leaves(straight), strict=True):
    np.testing.assert_array_equal(a, b)
