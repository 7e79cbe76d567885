"""pmap_ensemble: each member is exactly a single-device run from its own RNG."""

import jax
import numpy as np
import pytest
from conftest import NUM_DEVICES, CNNTrainer, cnn_config, image_batches, leaves

from strategies import member_rng

STEPS = 3


@pytest.fixture(scope="module")
def ensemble_run():
  batches = image_batches(STEPS + 1, 16)
  trainer = CNNTrainer(cnn_config(**{"strategy.name": "pmap_ensemble",
                                     "ensemble_size": NUM_DEVICES}))
  state = trainer.fit(batches[:STEPS], num_steps=STEPS)
  return trainer, state, batches


@pytest.fixture(scope="module")
def member_runs(ensemble_run):
  """Single-device runs started from each member's RNG, on the same batches."""
  _, _, batches = ensemble_run
  trainer = CNNTrainer(cnn_config(**{"strategy.name": "single_device"}))
  base = jax.random.PRNGKey(trainer.config.seed)
  states = []
  for i in range(NUM_DEVICES):
    state = trainer.init_state(batches[0], rng=member_rng(base, i))
    states.append(trainer.fit(batches[:STEPS], num_steps=STEPS, state=state))
  return trainer, states


def test_each_member_equals_its_single_device_run(ensemble_run, member_runs):
  trainer, state, _ = ensemble_run
  members = trainer.strategy.to_canonical(state.params)
  single, states = member_runs
  for i, member_state in enumerate(states):
    expected = single.strategy.to_canonical(member_state.params)
    for stacked, want in zip(leaves(members), leaves(expected), strict=True):
      np.testing.assert_allclose(stacked[i], want, rtol=1e-5, atol=1e-6)


def test_members_differ(ensemble_run):
  trainer, state, _ = ensemble_run
  kernel = np.asarray(trainer.strategy.to_canonical(state.params)["Dense_1"]["kernel"])
  assert kernel.shape[0] == NUM_DEVICES
  for i in range(1, NUM_DEVICES):
    assert not np.allclose(kernel[0], kernel[i])


def test_ensemble_prediction_is_mean_of_member_probabilities(ensemble_run, member_runs):
  trainer, state, batches = ensemble_run
  single, states = member_runs
  held_out = batches[STEPS]
  ensemble = trainer.predict(state, held_out)
  member_probs = np.stack([single.predict(s, held_out) for s in states])
  assert ensemble.shape == (16, 10)
  np.testing.assert_allclose(ensemble, member_probs.mean(axis=0), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(ensemble.sum(-1), 1.0, rtol=1e-5)
  # Averaging changed something: members disagree on these inputs.
  assert not np.allclose(member_probs[0], member_probs[1])


def test_ensemble_eval_reports_ensemble_and_member_metrics(ensemble_run, member_runs):
  trainer, state, batches = ensemble_run
  single, states = member_runs
  results = trainer.evaluate(state, batches[STEPS:])
  held_out = batches[STEPS]
  member_probs = np.stack([single.predict(s, held_out) for s in states])
  labels = held_out["label"]
  member_acc = (member_probs.argmax(-1) == labels).mean()
  ensemble_acc = (member_probs.mean(0).argmax(-1) == labels).mean()
  np.testing.assert_allclose(results["member_accuracy"], member_acc, rtol=1e-6)
  np.testing.assert_allclose(results["ensemble_accuracy"], ensemble_acc, rtol=1e-6)
  ensemble_probs = member_probs.mean(0)
  ensemble_nll = -np.log(ensemble_probs[np.arange(16), labels]).mean()
  np.testing.assert_allclose(results["ensemble_nll"], ensemble_nll, rtol=1e-4)
  disagreement = (member_probs.argmax(-1) != ensemble_probs.argmax(-1)).mean()
  np.testing.assert_allclose(results["disagreement"], disagreement, rtol=1e-6)
  # ECE with 15 equal-width bins, computed directly.
  ece = _ece(ensemble_probs, labels)
  np.testing.assert_allclose(results["ensemble_ece"], ece, rtol=1e-4, atol=1e-6)
  member_eces = [_ece(p, labels) for p in member_probs]
  np.testing.assert_allclose(results["member_ece"], np.mean(member_eces), rtol=1e-4, atol=1e-6)


def _ece(probs, labels, num_bins=15):
  confidence = probs.max(-1)
  correct = probs.argmax(-1) == labels
  bins = np.clip(np.ceil(confidence * num_bins).astype(int) - 1, 0, num_bins - 1)
  return sum(abs(correct[bins == b].sum() - confidence[bins == b].sum())
             for b in range(num_bins)) / len(labels)
