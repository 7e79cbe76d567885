"""The loop's contract with users: any eval/predict size, host-side metric merging, clear errors.

Eval and predict pad each chunk to a size the strategy splits and mask the
padding, so results never depend on `eval_batch_size` or the strategy. Step
metrics merge on the host in numpy (no jax op). Mistakes a user makes in the
first hour fail before training, naming what is wrong.
"""

import re

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from clu import metrics as clu_metrics
from conftest import (
  SHARDED_8,
  CNNTrainer,
  MLPTrainer,
  cnn_config,
  image_batches,
  mlp_config,
  vector_batches,
)

from strategies import Ensemble
from strategies.tree import merge_along_leading_axis
from trainer import metrics as metrics_lib
from trainer.checkpoint import Checkpointer
from trainer.step.errors import BatchKeyError


def _eval_set():
  """53 examples in batches of 20, 20 and 13: no size here splits over 8 replicas."""
  whole = image_batches(1, 53, seed=7)[0]
  return [{k: v[i:i + 20] for k, v in whole.items()} for i in (0, 20, 40)]


@pytest.fixture(scope="module")
def single_device_eval():
  trainer = CNNTrainer(cnn_config(eval_batch_size=53))
  state = trainer.init_state(image_batches(1, 16)[0])
  return trainer.evaluate(state, _eval_set()), trainer.predict(state, _eval_set()[0])


@pytest.mark.parametrize("overrides", [{"strategy.name": "pmap_data_parallel"}, SHARDED_8],
                         ids=["pmap_data_parallel", "sharded_data_parallel"])
@pytest.mark.parametrize("eval_batch_size", [20, 7])
def test_any_eval_batch_size_gives_the_single_device_metrics(single_device_eval, overrides,
                                                             eval_batch_size):
  trainer = CNNTrainer(cnn_config(eval_batch_size=eval_batch_size, **overrides))
  state = trainer.init_state(image_batches(1, 16)[0])
  results = trainer.evaluate(state, _eval_set())
  expected, expected_probs = single_device_eval
  assert results.keys() == expected.keys()
  for key in expected:
    np.testing.assert_allclose(results[key], expected[key], rtol=1e-5, atol=1e-6, err_msg=key)
  probs = trainer.predict(state, _eval_set()[0])
  assert probs.shape == (20, 10)
  np.testing.assert_allclose(probs, expected_probs, rtol=1e-5, atol=1e-6)


def test_ensemble_eval_and_predict_with_data_parallel_members_take_any_size():
  # Members 0-3 on a (4 ensemble x 2 data) mesh against the same members on (4 x 1).
  base = {"strategy.name": "sharded_ensemble", "ensemble_size": 4}
  split = CNNTrainer(cnn_config(eval_batch_size=7, **base,
                                **{"strategy.ensemble_mesh_shape": (4, 2)}))
  whole = CNNTrainer(cnn_config(eval_batch_size=53, **base,
                                **{"strategy.ensemble_mesh_shape": (4, 1)}))
  example = image_batches(1, 16)[0]
  split_state, whole_state = split.init_state(example), whole.init_state(example)
  got, want = split.evaluate(split_state, _eval_set()), whole.evaluate(whole_state, _eval_set())
  for key in want:
    np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6, err_msg=key)
  batch = {k: v[:13] for k, v in _eval_set()[0].items()}
  np.testing.assert_allclose(split.predict(split_state, batch),
                             whole.predict(whole_state, batch), rtol=1e-5, atol=1e-6)


def test_predict_runs_a_large_batch_in_eval_sized_chunks():
  trainer = CNNTrainer(cnn_config(eval_batch_size=20, **{"strategy.name": "pmap_data_parallel"}))
  state = trainer.init_state(image_batches(1, 16)[0])
  batch = image_batches(1, 45, seed=3)[0]
  probs = trainer.predict(state, batch)
  assert probs.shape == (45, 10)
  np.testing.assert_allclose(probs[:20], trainer.predict(state, {k: v[:20]
                                                                 for k, v in batch.items()}),
                             rtol=1e-6)


# -- Metrics merge on the host in numpy ------------------------------------------------------


@pytest.mark.parametrize("strategy", ["pmap_ensemble", "sharded_ensemble", "pmap_data_parallel"])
def test_step_metrics_merge_on_the_host_without_a_jax_op(strategy):
  trainer = CNNTrainer(cnn_config(**{"strategy.name": strategy, "ensemble_size": 8}))
  batches = image_batches(5, 16)
  state = trainer.init_state(batches[0])
  step = trainer.compiled.train(state)
  outputs = []
  for batch in batches:
    state, out = step(state, trainer.strategy.put_batch(batch))
    outputs.append(out["metrics"])
  expected = [jax.device_get(m) for m in outputs]
  if isinstance(trainer.strategy, Ensemble):  # clu's own reduction, a lax.scan per metric.
    expected = [m.reduce() for m in expected]
  else:
    expected = [jax.tree.map(lambda x: x[0], m) for m in expected]
  expected = expected[0].merge(expected[1]).merge(expected[2]).merge(expected[3]).merge(
      expected[4])
  jax.block_until_ready(outputs)
  # Any jax computation on host arrays would be an implicit transfer, which this forbids.
  with jax.transfer_guard("disallow"):
    got = metrics_lib.scalars(trainer.strategy.metrics_to_host(outputs))
  want = metrics_lib.scalars(expected)
  assert got.keys() == want.keys()
  for key in want:
    np.testing.assert_allclose(got[key], want[key], rtol=1e-6, err_msg=key)


def test_numpy_merge_over_members_matches_clu_reduce():
  # clu 0.0.12's Std.compute calls jnp.clip(a_min=...), which jax 0.10 removed: not tested.
  rng = np.random.default_rng(0)

  @flax.struct.dataclass
  class Kinds(clu_metrics.Collection):
    average: clu_metrics.Average.from_output("x")
    last: clu_metrics.LastValue.from_output("x")
    ece: metrics_lib.CalibrationError.from_output("probs")

  def member(i):
    probs = jax.nn.softmax(rng.normal(size=(6, 3)).astype(np.float32))
    return Kinds.single_from_model_output(x=jnp.asarray(rng.normal(size=6), jnp.float32),
                                          probs=probs, labels=jnp.arange(6) % 3)

  stacked = jax.device_get(jax.tree.map(lambda *xs: jnp.stack(xs), *[member(i) for i in range(5)]))
  want = metrics_lib.scalars(stacked.reduce())
  with jax.transfer_guard("disallow"):  # The merge itself runs no jax op.
    merged = merge_along_leading_axis(stacked)
  got = metrics_lib.scalars(merged)
  for key in want:
    np.testing.assert_allclose(got[key], want[key], rtol=1e-6, err_msg=key)


# -- Errors in the first hour ----------------------------------------------------------------


class _ScalarLoss(MLPTrainer):
  def loss(self, outputs, batch):
    return jnp.mean((outputs - batch["targets"]) ** 2)  # The mean, not one per example.


@pytest.mark.parametrize("strategy,per_replica", [("single_device", 16),
                                                  ("pmap_data_parallel", 2)])
def test_a_scalar_loss_is_named_before_training(tmp_path, strategy, per_replica):
  trainer = _ScalarLoss(mlp_config(**{"strategy.name": strategy}))
  checkpointer = Checkpointer(tmp_path, every_steps=1)
  with pytest.raises(ValueError, match=rf"_ScalarLoss\.loss returned shape \(\) for a batch of "
                                       rf"{per_replica} examples.*shape \({per_replica},\)"):
    trainer.fit(vector_batches(3, 16, 8), num_steps=3, checkpointer=checkpointer)
  assert checkpointer.all_steps() == []


def test_a_missing_input_entry_names_the_entries_the_batch_has():
  batches = [{"x": b["image"], "y": b["label"]} for b in image_batches(2, 16)]
  with pytest.raises(BatchKeyError, match=r"no entry 'image'; its entries are \['x', 'y'\].*"
                                          r"input_key='image' and target_key='label'"):
    CNNTrainer(cnn_config()).fit(batches, num_steps=2)


def test_a_missing_target_entry_names_the_entries_the_batch_has():
  batches = [{"image": b["image"], "labels": b["label"]} for b in image_batches(2, 16)]
  # The eval step is traced first (before training), with its padding mask.
  with pytest.raises(BatchKeyError, match=r"no entry 'label'; its entries are "
                                          r"\['image', 'labels', 'mask'\]"):
    CNNTrainer(cnn_config(**{"strategy.name": "pmap_data_parallel"})).fit(batches, num_steps=2)


@pytest.mark.parametrize("strategy", ["single_device", "pmap_data_parallel", "pmap_ensemble",
                                      "sharded_data_parallel", "sharded_ensemble"])
def test_a_short_train_batch_names_its_step_and_sizes(tmp_path, strategy):
  batches = vector_batches(4, 16, 8)
  batches[2] = {k: v[:10] for k, v in batches[2].items()}
  checkpointer = Checkpointer(tmp_path, every_steps=1)
  trainer = MLPTrainer(mlp_config(**{"strategy.name": strategy, "strategy.mesh_shape": (-1,),
                                     "strategy.mesh_axes": ("data",),
                                     "strategy.logical_axis_rules": (("batch", "data"),)}))
  with pytest.raises(ValueError, match=r"train batch for step 2 holds 10 examples in 'inputs' "
                                       r"\(shape \(10, 8\)\) but config.batch_size=16"):
    trainer.fit(batches, num_steps=4, checkpointer=checkpointer)
  assert checkpointer.all_steps() == [1, 2]  # Steps 0 and 1 ran and were saved; 2 never ran.


class _BrokenEval(CNNTrainer):
  train_traces = 0

  def train_step(self, state, batch):
    self.train_traces += 1
    return super().train_step(state, batch)

  def eval_metrics(self, logits, batch):
    del batch["weights"]  # A bug that only evaluation meets: no such entry.
    return super().eval_metrics(logits, batch)


@pytest.mark.parametrize("strategy", ["single_device", "pmap_ensemble"])
@pytest.mark.parametrize("with_eval_batches", [True, False])
def test_an_eval_only_mistake_fails_before_any_training(strategy, with_eval_batches):
  trainer = _BrokenEval(cnn_config(eval_every_steps=100, **{"strategy.name": strategy}))
  batches = image_batches(3, 16)
  with pytest.raises(BatchKeyError, match=r"no entry 'weights'; its entries are "
                                          r"\['image', 'label', 'mask'\]"):
    trainer.fit(batches, num_steps=3,
                eval_batches=(lambda: batches[:1]) if with_eval_batches else None)
  assert trainer.train_traces == 0


def test_a_rule_table_that_shards_no_parameter_is_refused_naming_the_rule():
  overrides = {"strategy.name": "sharded_data_parallel", "strategy.mesh_shape": (2, 4),
               "strategy.mesh_axes": ("data", "model"),
               "strategy.logical_axis_rules": (("batch", "data"), ("hidden", "model"))}
  with pytest.raises(ValueError, match=r"no parameter is sharded; the rule\(s\) "
                                       r"\('hidden', 'model'\) match no logical axis"):
    CNNTrainer(cnn_config(**overrides)).init_state(image_batches(1, 16)[0])


def test_a_rule_table_that_shards_a_parameter_does_not_warn(recwarn):
  MLPTrainer(mlp_config()).init_state(vector_batches(1, 16, 8)[0])
  assert not [w for w in recwarn if "logical_axis_rules" in str(w.message)]


def test_startup_is_this_programs_own_time_not_the_shells_before_it():
  """A shell that runs Python in its own process (`bash -c "pip ... && python ..."` does
  for its last command) spent 3 s first: the run's startup does not count them."""
  import subprocess
  import sys
  script = "import trainer; from trainer.loop import timing; print(timing.startup_seconds())"
  run = subprocess.run(["bash", "-c", f"sleep 3 && exec {sys.executable} -c '{script}'"],
                       capture_output=True, text=True, timeout=120, check=True)
  assert 0.0 <= float(run.stdout) < 3.0, run.stdout


def test_the_consoles_step_line_is_the_loss_the_rate_and_the_eta(caplog):
  """Every train scalar goes to the writers; the console's line at a log step is short,
  and the time breakdown is the run's last line, not every step's."""
  import logging

  from trainer.writers import LoggingWriter
  trainer = MLPTrainer(mlp_config(log_every_steps=2, num_train_steps=4))
  with caplog.at_level(logging.INFO):
    trainer.fit(vector_batches(4, 16, 8), num_steps=4, writer=LoggingWriter())
  lines = [r.getMessage() for r in caplog.records]
  steps = [line for line in lines if line.startswith("step ")]
  assert len(steps) == 2 and all(len(line) < 80 for line in steps), steps
  assert re.fullmatch(r"step 4/4: loss \S+, \S+ steps/s, ETA 0m00s", steps[-1]), steps
  assert not any("train/time_" in line for line in lines)
  assert any(line.startswith("Time: train ") for line in lines)
