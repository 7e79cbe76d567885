"""Sweeps that choose: successive halving and population-based training in one program.

The schedulers' decisions are checked on their own (pure functions of the
metrics, the step and the seed), then inside runs: a halving sweep of more
configurations than slots under `pmap_ensemble` and `sharded_ensemble` makes
the same choices, refills slots without recompiling, freezes slots with
nothing left to try, keeps a member that is never stopped equal to its single
run, and resumes after a SIGKILL to the same choices and parameters; a PBT
member that copied another holds its parent's state with explored
hyperparameters.
"""

import json
import logging
import pathlib
import re
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import cnn_config, image_batches
from user_models import FlaxStyleTrainer, NnxCNNTrainer

from strategies.single_device import SingleDevice
from trainer import Action
from trainer.sweep import Halving, PopulationBased, Sweep, suggest
from trainer.sweep.schedulers import check_config, program_steps


def _sweep(num: int, **overrides) -> tuple[Sweep, object]:
  config = cnn_config(**{"sweep.grid.learning_rate": tuple(0.01 * (i + 1) for i in range(num)),
                         "ensemble_size": 0, **overrides})
  return Sweep.from_config(config), config


def test_halving_stops_the_bottom_at_each_rung_refills_then_freezes():
  sweep, _ = _sweep(6, **{"sweep.scheduler": "halving"})
  h = Halving(sweep, slots=3, budget=6, mode="max", rungs=(2, 4), reduction_factor=2)
  # Step 2: trials 0-2 reach rung 2; the top ceil(3/2)=2 go on, trial 0 (worst) stops.
  d = h.observe(2, [0.1, 0.5, 0.4])
  assert dict(d.refill) == {0: 3} and d.frozen == () and not d.finished
  assert d.values[0]["learning_rate"] == sweep.members[3]["learning_rate"]
  assert h.slots == [3, 1, 2] and h.start == [2, 0, 0]
  # Step 4: trials 1, 2 at rung 4 (top 1 of 2: trial 2 stops); trial 3 at rung 2 with
  # 4 recorded there (0.1, 0.5, 0.4, 0.45): top 2 are 0.5 and 0.45, so it goes on.
  d = h.observe(4, [0.45, 0.6, 0.55])
  assert dict(d.refill) == {2: 4}
  # Step 6: trial 1 completes its 6 steps; trial 3 at rung 4 ranks 3rd of 3 there
  # (0.6, 0.55, 0.5): out; trial 4 at rung 2 ranks 5th of 5: out. The first freed slot
  # takes the last configuration; the other two are frozen, keeping their trials' state.
  d = h.observe(6, [0.5, 0.9, 0.05])
  assert dict(d.refill) == {0: 5} and d.frozen == (1, 2) and not d.finished
  assert d.export is None  # The completed trial stays in its (frozen) slot.
  statuses = {(r["trial"], r["status"]) for r in h.trials}
  assert statuses == {(0, "stopped"), (1, "completed"), (2, "stopped"), (3, "stopped"),
                      (4, "stopped"), (5, "running")}
  d = h.observe(8, [0.01, 0.9, 0.05])  # Trial 5 at rung 2: 6th of 6, out; nothing left.
  assert d.frozen == (0,) and d.finished and not d.refill
  assert h.labels() == [None, None, None]
  assert h.best_trial()["trial"] == 1
  # Model-steps: 2 + 6 + 4 + 4 + 2 + 2 = 20 of the grid's 36.
  assert h.model_steps(8) == 20


def test_derived_rungs_follow_the_trials_length_known_when_the_run_begins():
  from trainer.sweep import schedulers
  sweep, config = _sweep(4, **{"sweep.scheduler": "halving", "sweep.halving.min_steps": 36,
                               "sweep.halving.reduction_factor": 4.0,
                               "eval_every_steps": 36})
  h = schedulers.create(config, sweep, slots=2, budget=0)  # As `trainer.sweep.actions` does.
  h.set_budget(468)  # fit's num_steps, at `SweepReport.begin`.
  assert h.rungs == (36, 144) and len(h.recorded) == 2


def test_a_completed_trial_whose_slot_is_refilled_is_exported_first():
  sweep, _ = _sweep(4, **{"sweep.scheduler": "halving"})
  h = Halving(sweep, slots=2, budget=2, mode="max", rungs=(), reduction_factor=2)
  d = h.observe(2, [0.3, 0.7])  # Both complete; both slots take new configurations.
  assert dict(d.refill) == {0: 2, 1: 3} and d.export == (1, 1)
  d = h.observe(4, [0.9, 0.1])  # Better than the one exported: the summary exports it.
  assert d.finished and d.export is None and h.best_trial()["trial"] == 2


def test_halving_resumes_from_its_state_to_the_same_choices():
  sweep, _ = _sweep(8, **{"sweep.scheduler": "halving"})
  metrics = np.random.default_rng(0).random((6, 4))
  first = Halving(sweep, slots=4, budget=8, mode="min", rungs=(2, 4), reduction_factor=2)
  decisions = [first.observe(2 * (i + 1), list(m)) for i, m in enumerate(metrics)]
  again = Halving(sweep, slots=4, budget=8, mode="min", rungs=(2, 4), reduction_factor=2)
  for i, m in enumerate(metrics[:3]):
    again.observe(2 * (i + 1), list(m))
  saved = json.loads(json.dumps(again.state_dict()))  # What a checkpoint keeps.
  resumed = Halving(sweep, slots=4, budget=8, mode="min", rungs=(2, 4), reduction_factor=2)
  resumed.load_state_dict(saved)
  for i, m in list(enumerate(metrics))[3:]:
    assert resumed.observe(2 * (i + 1), list(m)) == decisions[i]
  assert resumed.state_dict() == json.loads(json.dumps(first.state_dict()))


def test_pbt_copies_the_top_into_the_bottom_and_explores_within_range():
  sweep, config = _sweep(8, **{"sweep.scheduler": "pbt"})
  kwargs = dict(slots=8, budget=100, mode="max", ready_steps=10, fraction=0.25,
                perturb=(0.8, 1.2), resample_probability=0.25,
                ranges={"learning_rate": (0.005, 0.2)}, seed=3)
  pbt = PopulationBased(sweep, **kwargs)
  values = [0.1, 0.9, 0.3, 0.8, 0.2, 0.7, 0.05, 0.6]
  assert not pbt.observe(5, values).copy  # Not a ready step.
  d = pbt.observe(10, values)
  assert sorted(d.copy) == [0, 6]  # The two worst...
  assert set(d.copy.values()) <= {1, 3}  # ...copy from the two best.
  for child, parent in d.copy.items():
    lr = d.values[child]["learning_rate"]
    assert 0.005 <= lr <= 0.2
    assert lr != sweep.members[parent]["learning_rate"]  # Explored, not the parent's.
    assert d.values[child]["seed"] == sweep.members[parent]["seed"]
  assert [e["child"] for e in pbt.lineage] == [0, 6]
  # The same seed and metrics make the same choices; another seed other draws.
  assert PopulationBased(sweep, **kwargs).observe(10, values) == d
  other = PopulationBased(sweep, **{**kwargs, "seed": 4}).observe(10, values)
  assert other.values != d.values


def test_pbt_resumes_from_its_state_to_the_same_choices():
  sweep, _ = _sweep(8, **{"sweep.scheduler": "pbt"})
  kwargs = dict(slots=8, budget=100, mode="min", ready_steps=2, fraction=0.25,
                perturb=(0.8, 1.2), resample_probability=0.5,
                ranges={"learning_rate": (0.001, 1.0)}, seed=0)
  metrics = np.random.default_rng(1).random((5, 8))
  first = PopulationBased(sweep, **kwargs)
  decisions = [first.observe(2 * (i + 1), list(m)) for i, m in enumerate(metrics)]
  again = PopulationBased(sweep, **kwargs)
  for i, m in enumerate(metrics[:2]):
    again.observe(2 * (i + 1), list(m))
  resumed = PopulationBased(sweep, **kwargs)
  resumed.load_state_dict(json.loads(json.dumps(again.state_dict())))
  for i, m in list(enumerate(metrics))[2:]:
    assert resumed.observe(2 * (i + 1), list(m)) == decisions[i]
  assert resumed.lineage == json.loads(json.dumps(first.lineage))


@pytest.mark.parametrize("overrides, message", [
    ({"sweep.scheduler": "asha"}, "config.sweep.scheduler='asha' is not one of"),
    ({"sweep.scheduler": "halving", "sweep.grid.learning_rate": ()},
     "chooses between a sweep's configurations"),
    ({"sweep.scheduler": "halving", "sweep.halving.reduction_factor": 1},
     "reduction_factor=1.0 must be > 1"),
    ({"sweep.scheduler": "halving", "sweep.halving.rungs": (2, 3)},
     "multiples of config.eval_every_steps=2"),
    ({"sweep.scheduler": "pbt", "sweep.pbt.fraction": 0.75}, "fraction=0.75 must be in (0, 0.5]"),
    ({"sweep.scheduler": "pbt", "sweep.pbt.ranges.momentum": (0.5, 1.5)},
     "ranges.momentum=(0.5, 1.5) must be a range"),
    ({"sweep.scheduler": "pbt", "sweep.grid.learning_rate": (), "sweep.seeds": (0, 1)},
     "there are none"),
])
def test_a_scheduler_that_cannot_work_is_refused_naming_the_field(overrides, message):
  config = cnn_config(**{"sweep.grid.learning_rate": (0.1, 0.2), "ensemble_size": 0,
                         "eval_every_steps": 2, **overrides})
  with pytest.raises(ValueError, match=re.escape(message)):
    check_config(config, Sweep.from_config(config))
    FlaxStyleTrainer(config)


# -- Inside runs ---------------------------------------------------------------------------

HALVING = {"sweep.scheduler": "halving", "sweep.grid.learning_rate": (0.3, 0.1, 0.03, 0.01, 0.003,
                                                                       0.001),
           "sweep.seeds": (0, 1), "sweep.metric": "nll", "sweep.mode": "min",
           "sweep.halving.rungs": (2, 4), "sweep.halving.reduction_factor": 2.0,
           "ensemble_size": 8, "eval_every_steps": 2, "schedule.warmup_steps": 0}
STRATEGIES = {
    "pmap_ensemble": {"strategy.name": "pmap_ensemble"},
    "sharded_ensemble": {"strategy.name": "sharded_ensemble",
                         "strategy.ensemble_mesh_shape": (4, 1)},  # 2 members per device.
}


class _Compiles(logging.Handler):
  """The names of the functions jax compiles (`jax.log_compiles`)."""

  def __init__(self):
    super().__init__(logging.DEBUG)
    self.names = []

  def emit(self, record):
    message = record.getMessage()
    if message.startswith("Compiling "):
      self.names.append(message.split()[1])


class Snapshots(Action):
  """Every slot's parameters after each evaluation's choices (host copies)."""

  def __init__(self, strategy, compiles):
    super().__init__(every_steps=2)
    self.strategy, self.compiles, self.params, self.compiled = strategy, compiles, {}, {}

  def run(self, view):
    self.params[view.step] = jax.tree.map(np.asarray,
                                          self.strategy.to_canonical(view.state.params))
    self.compiled[view.step] = list(self.compiles.names)


def _halving_run(name, workdir, trainer_class=FlaxStyleTrainer, **extra):
  config = cnn_config(**{**HALVING, **STRATEGIES[name], **extra})
  trainer = trainer_class(config)
  batches = image_batches(24, 16)
  compiles = _Compiles()
  snapshots = Snapshots(trainer.strategy, compiles)
  logging.getLogger("jax").addHandler(compiles)
  try:
    with jax.log_compiles():
      result = trainer.fit(lambda s: batches[s:], num_steps=6, workdir=str(workdir),
                           eval_batches=lambda: image_batches(2, 16, seed=9),
                           actions=[snapshots])
  finally:
    logging.getLogger("jax").removeHandler(compiles)
  result.snapshots, result.compiled = snapshots.params, snapshots.compiled
  return trainer, result, json.loads((workdir / "sweep.json").read_text())


@pytest.fixture(scope="module")
def halving_runs(tmp_path_factory):
  return {name: _halving_run(name, tmp_path_factory.mktemp(name)) for name in STRATEGIES}


def test_halving_runs_more_configurations_than_slots_in_one_program(halving_runs):
  trainer, result, summary = halving_runs["pmap_ensemble"]
  assert program_steps(trainer.sweep, trainer.strategy, 6) == 12  # 12 configs in 8 slots.
  assert summary["scheduler"] == "halving" and summary["budget"] == 6
  trials = summary["trials"]
  assert sorted({r["trial"] for r in trials}) == list(range(12))  # Every configuration ran.
  assert {r["status"] for r in trials} <= {"stopped", "completed"}
  assert result.stopped_by.startswith("sweep finished")
  # Four stop at the first rung; their slots take configurations 8-11 fresh.
  refills = [e for e in summary["events"] if e["event"] == "refill"]
  assert [e["trial"] for e in refills] == [8, 9, 10, 11]
  assert all(e["step"] == 2 for e in refills)
  assert summary["model_steps"] == sum(r["end"] - r["start"] for r in trials) < 12 * 6
  # After the first refill nothing compiles again: the state kept its shapes and placement.
  assert result.compiled[2] and result.compiled[result.step] == result.compiled[2]


def test_the_same_halving_sweep_makes_the_same_choices_under_both_ensembles(halving_runs):
  choices = {name: [(e["step"], e["event"], e["slot"], e.get("trial"))
                    for e in run[2]["events"]] for name, run in halving_runs.items()}
  assert choices["pmap_ensemble"] == choices["sharded_ensemble"]
  best = {name: run[2]["best"]["trial"] for name, run in halving_runs.items()}
  assert best["pmap_ensemble"] == best["sharded_ensemble"]


def test_a_frozen_slot_keeps_its_state_and_a_kept_member_is_its_single_run(halving_runs):
  trainer, result, summary = halving_runs["sharded_ensemble"]
  final = trainer.strategy.to_canonical(result.state)
  # A slot frozen before the end holds, bit for bit, what its last trial ended with.
  frozen = [e for e in summary["events"] if e["event"] == "freeze" and e["step"] < result.step]
  assert frozen
  for event in frozen:
    at_freeze = result.snapshots[event["step"]]
    for a, b in zip(jax.tree.leaves(at_freeze), jax.tree.leaves(final.params), strict=True):
      np.testing.assert_array_equal(np.asarray(b)[event["slot"]], a[event["slot"]])
  # A refilled slot starts from its configuration's seed: its single run's first state.
  config = cnn_config(**{**HALVING, **STRATEGIES["sharded_ensemble"]})
  refill = next(e for e in summary["events"] if e["event"] == "refill")
  fresh = FlaxStyleTrainer(trainer.sweep.member_config(config, refill["trial"]),
                           strategy=SingleDevice()).init_state(image_batches(1, 16)[0])
  for a, b in zip(jax.tree.leaves(fresh.params),
                  jax.tree.leaves(result.snapshots[refill["step"]]), strict=True):
    np.testing.assert_array_equal(b[refill["slot"]], a)
  # A configuration of the first eight that was never stopped trained exactly its single run.
  kept = [r for r in summary["trials"] if r["status"] == "completed" and r["start"] == 0]
  assert kept
  record = kept[0]
  member = trainer.sweep.member_config(config, record["trial"])
  single = FlaxStyleTrainer(member, strategy=SingleDevice())
  batches = image_batches(24, 16)
  want = single.strategy.to_canonical(single.fit(lambda s: batches[s:], num_steps=6).state)
  for a, b in zip(jax.tree.leaves(want.params), jax.tree.leaves(final.params), strict=True):
    np.testing.assert_allclose(np.asarray(b)[record["slot"]], a, rtol=1e-5, atol=1e-6)


# -- Killed and resumed --------------------------------------------------------------------

SCRIPT = pathlib.Path(__file__).parent / "sweep_run.py"


def _sweep_process(workdir, out, scheduler, *extra):
  return subprocess.run([sys.executable, str(SCRIPT), f"--workdir={workdir}", f"--out={out}",
                         f"--scheduler={scheduler}", *extra],
                        capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("scheduler", ["halving"])  # PBT's state: the test below.
def test_a_sweep_killed_between_choices_resumes_to_the_same_choices_and_state(tmp_path,
                                                                              scheduler):
  straight = _sweep_process(tmp_path / "straight", tmp_path / "straight.npz", scheduler)
  assert straight.returncode == 0, straight.stderr[-3000:]
  killed = _sweep_process(tmp_path / "work", tmp_path / "final.npz", scheduler,
                          "--kill_after_save_at=2")
  assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
  assert not (tmp_path / "final.npz").exists()
  resumed = _sweep_process(tmp_path / "work", tmp_path / "final.npz", scheduler)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "Resuming at step 2" in resumed.stderr
  want = json.loads((tmp_path / "straight" / "sweep.json").read_text())
  got = json.loads((tmp_path / "work" / "sweep.json").read_text())
  assert got["events"] == want["events"] and got["trials"] == want["trials"]
  assert any(e["step"] > 2 for e in want["events"])  # Choices were made after the kill.
  a, b = np.load(tmp_path / "straight.npz"), np.load(tmp_path / "final.npz")
  assert sorted(a) == sorted(b)
  for key in a:
    np.testing.assert_array_equal(a[key], b[key], err_msg=key)  # Bit for bit.


def test_pbt_members_copy_their_parents_state_and_train_with_explored_values(tmp_path):
  # An NNX model under sharded_ensemble, 2 members per device.
  config = cnn_config(**{
      "strategy.name": "sharded_ensemble", "strategy.ensemble_mesh_shape": (2, 1),
      "ensemble_size": 0, "sweep.scheduler": "pbt", "sweep.pbt.ready_steps": 2,
      "sweep.pbt.fraction": 0.5, "sweep.grid.learning_rate": (0.3, 0.03),
      "sweep.seeds": (0, 1),
      "sweep.metric": "nll", "sweep.mode": "min", "eval_every_steps": 2,
      "schedule.warmup_steps": 0})
  trainer = NnxCNNTrainer(config)
  compiles = _Compiles()
  snapshots = Snapshots(trainer.strategy, compiles)
  batches = image_batches(8, 16)
  state_at = {}

  class States(Action):  # The whole state (canonical) after each evaluation's choices.
    def run(self, view):
      state_at[view.step] = jax.tree.map(np.asarray, trainer.strategy.to_canonical(view.state))

  result = trainer.fit(lambda s: batches[s:], num_steps=4, workdir=str(tmp_path),
                       eval_batches=lambda: image_batches(2, 16, seed=9),
                       actions=[States(every_steps=2), snapshots])
  summary = json.loads((tmp_path / "sweep.json").read_text())
  copies = [e for e in summary["lineage"] if e["step"] == 2]
  assert len(copies) == 2  # Half of 4 at the bottom.
  after = state_at[2]
  for copy in copies:
    child, parent = copy["child"], copy["parent"]
    # Parameters, model state and optimizer moments are the parent's, bit for bit...
    for name in ("params", "model_state"):
      for x in jax.tree.leaves(getattr(after, name)):
        np.testing.assert_array_equal(x[child], x[parent])
    for x in jax.tree.leaves(after.opt_state.inner_state):
      np.testing.assert_array_equal(x[child], x[parent])
    # ...the RNG stays the child's own (its single run's), and it trains with the explored rate.
    own = NnxCNNTrainer(trainer.sweep.member_config(config, child),
                        strategy=SingleDevice()).init_state(batches[0]).rng
    np.testing.assert_array_equal(after.rng[child], own)
    assert not np.array_equal(after.rng[child], after.rng[parent]) or (
        trainer.sweep.members[child]["seed"] == trainer.sweep.members[parent]["seed"])
    lr = after.opt_state.hyperparams["learning_rate"]
    np.testing.assert_allclose(lr[child], copy["after"]["learning_rate"], rtol=1e-6)
    assert copy["after"]["learning_rate"] != copy["before"]["learning_rate"]
  # Nothing compiled after the first choices; the best member is exported with its values.
  assert snapshots.compiled[4] == snapshots.compiled[2]
  best = json.loads((tmp_path / "sweep_best_config.json").read_text())
  record = summary["best"]
  assert best["learning_rate"] == pytest.approx(record["learning_rate"])
  assert result.step == 4


# -- The learning-rate range test ----------------------------------------------------------

def test_the_range_test_suggests_the_steepest_stable_rate():

  rates = [1e-3, 1e-2, 1e-1, 1.0, 10.0]
  steps = np.arange(50)
  finals = [2.2, 1.5, 0.4, 0.3, np.nan]  # 10.0 goes non-finite.
  losses = np.stack([2.3 + (f - 2.3) * (1 - np.exp(-steps / 10)) if np.isfinite(f)
                     else np.where(steps < 20, 2.3, np.inf) for f in finals])
  losses[3, -25:] = 4.0  # 1.0 ends well above where it began: diverged too.
  got = suggest(rates, losses)
  assert got["diverged"] == [False, False, False, True, True]
  assert got["largest_stable"] == 0.1 and got["lowest_loss"] == 0.1
  assert got["steepest"] == 0.1  # The largest fall per decade: 1.5 -> 0.4.


def test_a_range_test_records_every_members_loss_at_every_step(tmp_path):
  config = cnn_config(**{"strategy.name": "pmap_ensemble", "ensemble_size": 0,
                         "sweep.grid.learning_rate": tuple(np.geomspace(1e-3, 30.0, 8)),
                         "sweep.lr_find": True, "nonfinite": "skip", "steps_per_call": 2,
                         "schedule.warmup_steps": 0})
  trainer = FlaxStyleTrainer(config)
  batches = image_batches(12, 16)
  trainer.fit(lambda s: batches[s:], num_steps=12, workdir=str(tmp_path))  # No evaluation.
  found = json.loads((tmp_path / "lr_find.json").read_text())
  assert (tmp_path / "lr_find.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  losses = np.asarray(found["losses"], float)
  assert losses.shape == (8, 12) and found["steps"] == 12  # 2 steps a call, each kept.
  assert found["learning_rates"] == pytest.approx(list(np.geomspace(1e-3, 30.0, 8)))
  assert found["diverged"][-1] and not found["diverged"][0]
  assert found["steepest"] in found["learning_rates"]
  # Member 0's curve is its single run's loss at each step.
  single = FlaxStyleTrainer(trainer.sweep.member_config(config, 0), strategy=SingleDevice())
  seen = []

  class Losses(Action):
    def run(self, view):
      m = single.strategy.fetch_metrics([view.outputs["metrics"]])[0]
      seen.extend(np.atleast_1d(np.asarray(m.loss.total) / np.asarray(m.loss.count)))

  single.fit(lambda s: batches[s:], num_steps=12, actions=[Losses(every_steps=1)])
  np.testing.assert_allclose(losses[0], seen, rtol=1e-5)


def test_a_range_test_without_rates_is_refused():
  config = cnn_config(**{"sweep.lr_find": True, "sweep.seeds": (0, 1), "ensemble_size": 0,
                         "strategy.name": "sharded_ensemble"})
  with pytest.raises(ValueError, match=r"config.sweep.lr_find=True reads the loss"):
    FlaxStyleTrainer(config)
