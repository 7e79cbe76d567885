"""Ensemble metrics against values computed by hand on small arrays."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainer import metrics

# Four examples in four different confidence bins of 15, one more sharing bin 14.
PROBS = np.array([[0.95, 0.05], [0.25, 0.75], [0.62, 0.38], [0.3, 0.7], [0.96, 0.04]],
                 np.float32)
LABELS = np.array([0, 0, 0, 1, 1], np.int32)


def test_ece_sums_each_bin_before_taking_the_gap():
  ece = metrics.CalibrationError.from_probs(jnp.asarray(PROBS), jnp.asarray(LABELS))
  # Bin 14: correct 1 of 2, confidence 0.95 + 0.96 -> |1 - 1.91| = 0.91.
  # Bins 11, 9, 10: |0 - 0.75|, |1 - 0.62|, |1 - 0.7|.
  expected = (0.91 + 0.75 + 0.38 + 0.30) / 5
  np.testing.assert_allclose(ece.compute(), expected, rtol=1e-5)
  assert ece.count.tolist() == [0] * 9 + [1, 1, 1, 0, 0, 2]


def test_ece_merges_exactly_and_respects_the_mask():
  whole = metrics.CalibrationError.from_probs(jnp.asarray(PROBS), jnp.asarray(LABELS))
  parts = metrics.CalibrationError.from_probs(jnp.asarray(PROBS[:2]), jnp.asarray(LABELS[:2]))
  parts = parts.merge(metrics.CalibrationError.from_probs(jnp.asarray(PROBS[2:]),
                                                          jnp.asarray(LABELS[2:])))
  np.testing.assert_allclose(parts.compute(), whole.compute(), rtol=1e-6)
  padded = np.concatenate([PROBS, [[0.99, 0.01]]]).astype(np.float32)
  masked = metrics.CalibrationError.from_probs(
      jnp.asarray(padded), jnp.asarray(np.append(LABELS, 1)),
      jnp.asarray([1, 1, 1, 1, 1, 0], np.float32))
  np.testing.assert_allclose(masked.compute(), whole.compute(), rtol=1e-6)


def test_perfectly_calibrated_is_zero():
  probs = jnp.asarray([[0.5, 0.5], [0.5, 0.5]], jnp.float32)
  ece = metrics.CalibrationError.from_probs(probs, jnp.asarray([0, 1], jnp.int32))
  # argmax picks class 0 for both; one right, one wrong, confidence 0.5 each.
  np.testing.assert_allclose(ece.compute(), 0.0, atol=1e-7)


def test_nll_by_hand():
  got = metrics.nll(jnp.asarray(PROBS), jnp.asarray(LABELS))
  np.testing.assert_allclose(got, -np.log([0.95, 0.25, 0.62, 0.7, 0.04]), rtol=1e-6)
  zero = metrics.nll(jnp.asarray([[1.0, 0.0]]), jnp.asarray([1]))
  assert np.isfinite(zero).all() and zero[0] > 80


def test_ensemble_collection_merged_over_members_by_hand():
  # Three members, three examples, three classes; label 0 for all.
  members = np.array([
      [[0.7, 0.2, 0.1], [0.4, 0.5, 0.1], [0.2, 0.3, 0.5]],
      [[0.6, 0.3, 0.1], [0.6, 0.3, 0.1], [0.1, 0.8, 0.1]],
      [[0.2, 0.7, 0.1], [0.5, 0.4, 0.1], [0.3, 0.3, 0.4]],
  ], np.float32)
  labels = np.zeros(3, np.int32)
  ensemble = members.mean(0)  # argmax: 0, 0, 1
  per_member = []
  for m in range(3):
    argmax = members[m].argmax(-1)
    per_member.append(metrics.EnsembleEvalMetrics.single_from_model_output(
        ensemble_correct=jnp.asarray(ensemble.argmax(-1) == labels, jnp.float32),
        member_correct=jnp.asarray(argmax == labels, jnp.float32),
        ensemble_nll=metrics.nll(jnp.asarray(ensemble), jnp.asarray(labels)),
        member_nll=metrics.nll(jnp.asarray(members[m]), jnp.asarray(labels)),
        ensemble_probs=jnp.asarray(ensemble),
        probs=jnp.asarray(members[m]), member_index=m, num_members=3,
        disagrees=jnp.asarray(argmax != ensemble.argmax(-1), jnp.float32),
        labels=jnp.asarray(labels), mask=jnp.ones(3)))
  stacked = jax.tree.map(lambda *x: jnp.stack(x), *per_member)
  got = stacked.reduce().compute()  # What pmap_ensemble's host view does.
  # Member argmaxes: [0,1,2], [0,0,1], [1,0,2]; ensemble argmax [0,0,1].
  assert got["member_accuracy"] == pytest.approx(4 / 9)
  assert got["ensemble_accuracy"] == pytest.approx(2 / 3)
  assert got["disagreement"] == pytest.approx((2 + 0 + 2) / 9)
  assert got["ensemble_nll"] == pytest.approx(-np.log([0.5, 0.5, 0.2]).mean(), rel=1e-5)
  assert got["member_nll"] == pytest.approx(-np.log(members[:, :, 0]).mean(), rel=1e-5)
  # Ensemble confidences 0.5 (bin 7), 0.5 (bin 7), 0.4667 (bin 7): 2 right of 3.
  conf = ensemble.max(-1).sum()
  assert got["ensemble_ece"] == pytest.approx(abs(2 - conf) / 3, rel=1e-5)
  # Each member's own ECE (one example per bin here except where noted), then the mean:
  # member 0: conf .7 right, .5 wrong, .5 wrong (bin 7 twice) -> (.3 + |0 - 1.0|) / 3
  # member 1: conf .6 right, .6 right (bin 8 twice), .8 wrong -> (|2 - 1.2| + .8) / 3
  # member 2: conf .7 wrong, .5 right, .4 wrong (bins 10, 7, 5) -> (.7 + .5 + .4) / 3
  member_eces = [(0.3 + 1.0) / 3, (0.8 + 0.8) / 3, (0.7 + 0.5 + 0.4) / 3]
  assert got["member_ece"] == pytest.approx(np.mean(member_eces), rel=1e-5)
  # Pooling all members into one set of bins would give a different (smaller) number.
  pooled = metrics.CalibrationError.from_probs(
      jnp.asarray(members.reshape(-1, 3)), jnp.zeros(9, jnp.int32)).compute()
  assert float(pooled) < got["member_ece"] - 0.05
