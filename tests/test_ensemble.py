"""Ensembles (pmap and jit): each member is exactly a single-device run from its own RNG.

The same tests run for `pmap_ensemble` (one member per device) and for
`sharded_ensemble` with one member per device, two per device (16 on 8),
four on one device (unrolled, looped and vectorised), and 4 members x 2-way data
parallelism inside each member.
"""

import jax
import numpy as np
import pytest
from conftest import CNNTrainer, cnn_config, image_batches, leaves

from strategies import member_rng

STEPS = 3


ENSEMBLES = {
    "pmap_8": {"strategy.name": "pmap_ensemble", "ensemble_size": 8},
    "jit_8_on_8": {"strategy.name": "sharded_ensemble", "ensemble_size": 8},
    "jit_16_on_8": {"strategy.name": "sharded_ensemble", "ensemble_size": 16},
    "jit_4_on_1_map": {"strategy.name": "sharded_ensemble", "ensemble_size": 4,
                       "strategy.ensemble_mesh_shape": (1, 1), "strategy.ensemble_loop": "map"},
    "jit_4_on_1_vmap": {"strategy.name": "sharded_ensemble", "ensemble_size": 4,
                        "strategy.ensemble_mesh_shape": (1, 1),
                        "strategy.ensemble_loop": "vmap"},
    "jit_4_on_1_unroll": {"strategy.name": "sharded_ensemble", "ensemble_size": 4,
                          "strategy.ensemble_mesh_shape": (1, 1),
                          "strategy.ensemble_loop": "unroll"},
    "jit_4x2_data": {"strategy.name": "sharded_ensemble", "ensemble_size": 4,
                     "strategy.ensemble_mesh_shape": (4, 2)},
}
_SINGLE_RUNS = {}


@pytest.fixture(scope="module", params=list(ENSEMBLES))
def ensemble_run(request):
  batches = image_batches(STEPS + 1, 16)
  trainer = CNNTrainer(cnn_config(**ENSEMBLES[request.param]))
  state = trainer.fit(batches[:STEPS], num_steps=STEPS).state
  return trainer, state, batches


@pytest.fixture(scope="module")
def member_runs(ensemble_run):
  """Single-device runs started from each member's RNG, on the same batches (cached)."""
  ensemble, _, batches = ensemble_run
  if "trainer" not in _SINGLE_RUNS:
    _SINGLE_RUNS["trainer"] = CNNTrainer(cnn_config(**{"strategy.name": "single_device"}))
  trainer = _SINGLE_RUNS["trainer"]
  base = jax.random.PRNGKey(trainer.config.seed)
  for i in range(ensemble.strategy.num_members):
    if i not in _SINGLE_RUNS:
      state = trainer.init_state(batches[0], rng=member_rng(base, i))
      _SINGLE_RUNS[i] = trainer.fit(batches[:STEPS], num_steps=STEPS, state=state).state
  return trainer, [_SINGLE_RUNS[i] for i in range(ensemble.strategy.num_members)]


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
  assert kernel.shape[0] == trainer.strategy.num_members
  for i in range(1, trainer.strategy.num_members):
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


def test_sharded_ensemble_matches_pmap_ensemble_member_by_member():
  batches = image_batches(STEPS, 16)
  pmap = CNNTrainer(cnn_config(**ENSEMBLES["pmap_8"]))
  jit = CNNTrainer(cnn_config(**ENSEMBLES["jit_8_on_8"]))
  pmap_params = pmap.strategy.to_canonical(pmap.fit(batches, num_steps=STEPS).state.params)
  jit_params = jit.strategy.to_canonical(jit.fit(batches, num_steps=STEPS).state.params)
  for a, b in zip(leaves(pmap_params), leaves(jit_params), strict=True):
    assert a.shape[0] == 8
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
