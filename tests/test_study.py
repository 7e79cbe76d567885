"""An Optuna study as a sweep's source of configurations (`trainer/sweep/study.py`): the
ensemble's slots are the study's concurrent trials, pruned at evaluations and refilled in
the one compiled program; the study in a journal file that survives SIGKILL, is shared
between runs and is read by optuna-dashboard."""

import json
import pathlib
import socket
import subprocess
import sys
import threading
import urllib.request
import wsgiref.simple_server

import jax
import numpy as np
import optuna
import pytest
from conftest import cnn_config, image_batches
from user_models import FlaxStyleTrainer

from strategies.single_device import SingleDevice
from trainer.config import check_config, unknown_override
from trainer.sweep import study as study_lib
from trainer.sweep.members import Sweep

# 4 slots; 6 trials of 6 steps; halving at the ages 2 and 4 (keep the top half).
STUDY = {"strategy.name": "sharded_ensemble", "strategy.ensemble_mesh_shape": (4, 1),
         "ensemble_size": 4, "optimizer": "sgd", "sweep.metric": "nll", "sweep.mode": "min",
         "eval_every_steps": 2, "schedule.warmup_steps": 0,
         "sweep.study.space.learning_rate": ("log", 0.001, 0.3),
         "sweep.study.space.momentum": ("float", 0.0, 0.95),
         "sweep.study.n_trials": 6, "sweep.study.pruner": "halving",
         "sweep.halving.rungs": (2, 4)}


def _journal(path):
  return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(path)))


@pytest.fixture(scope="module")
def study_run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("study")
  config = cnn_config(**STUDY)
  trainer = FlaxStyleTrainer(config)
  batches = image_batches(24, 16)
  result = trainer.fit(lambda s: batches[s:], num_steps=6, workdir=str(workdir),
                       eval_batches=lambda: image_batches(2, 16, seed=9))
  return config, trainer, result, workdir, json.loads((workdir / "sweep.json").read_text())


def test_a_study_fills_every_slot_prunes_refills_and_exports_its_best(study_run):
  config, trainer, result, workdir, summary = study_run
  study = optuna.load_study(study_name="sweep", storage=_journal(workdir / "study.journal"))
  trials = study.get_trials()
  assert [t.number for t in trials] == list(range(6))  # n_trials, each asked once.
  states = [t.state for t in trials]
  assert optuna.trial.TrialState.PRUNED in states and optuna.trial.TrialState.COMPLETE in states
  assert optuna.trial.TrialState.RUNNING not in states
  # Each trial reported at its own ages (its steps), and trained its values in its slot.
  for t, record in zip(trials, summary["trials"], strict=True):
    assert record["trial"] == t.number and t.user_attrs["sweep"]["slot"] == record["slot"]
    assert sorted(t.intermediate_values) == [age for _, age, _ in record["curve"]]
    assert [t.intermediate_values[a] for _, a, _ in record["curve"]] == pytest.approx(
        [v for _, _, v in record["curve"]])
    assert {n: record["values"][n] for n in t.params} == pytest.approx(t.params)
    status = {"PRUNED": "stopped", "COMPLETE": "completed"}[t.state.name]
    assert record["status"] == status
  # Pruned slots took new trials at that evaluation; once the study was full they froze.
  refills = [e for e in summary["events"] if e["event"] == "refill" and e["step"] > 0]
  assert refills and {e["trial"] for e in refills} == {4, 5}
  assert result.stopped_by.startswith("sweep finished")
  assert summary["model_steps"] < 6 * 6
  assert summary["study"]["states"]["pruned"] >= 2
  # The study's best trial is the one exported, and the study says where.
  best = study.best_trial
  assert json.loads((workdir / "sweep_best_config.json").read_text())["learning_rate"] == (
      pytest.approx(best.params["learning_rate"]))
  assert study.user_attrs["sweep_best"]["trial"] == best.number
  assert study.user_attrs["sweep_best"]["checkpoint"] == str(workdir / "sweep_best")
  assert (workdir / "sweep_best").is_dir()
  assert {"sweep.png", "sweep_curves.png"} <= {p.name for p in workdir.iterdir()}


def test_a_trial_never_pruned_is_its_single_run(study_run):
  config, trainer, result, workdir, summary = study_run
  # A trial that held its slot from the start, completed, and was never replaced.
  kept = [r for r in summary["trials"] if r["status"] == "completed" and r["start"] == 0
          and not any(o["slot"] == r["slot"] and o["start"] > 0 for o in summary["trials"])]
  assert kept
  record = kept[0]
  member = Sweep.from_config(config).member_config(config, record["trial"], record["values"])
  assert member.learning_rate == record["values"]["learning_rate"]
  assert not member.sweep.study.space.learning_rate  # A single run: no study.
  single = FlaxStyleTrainer(member, strategy=SingleDevice())
  batches = image_batches(24, 16)
  want = single.strategy.to_canonical(single.fit(lambda s: batches[s:], num_steps=6).state)
  final = trainer.strategy.to_canonical(result.state)
  for a, b in zip(jax.tree.leaves(want.params), jax.tree.leaves(final.params), strict=True):
    np.testing.assert_allclose(np.asarray(b)[record["slot"]], a, rtol=1e-5, atol=1e-6)


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_optuna_dashboard_shows_the_trials_their_reports_and_the_pruned(study_run):
  import optuna_dashboard
  workdir = study_run[3]
  app = optuna_dashboard.wsgi(str(workdir / "study.journal"))
  server = wsgiref.simple_server.make_server("127.0.0.1", 0, app)
  thread = threading.Thread(target=server.serve_forever, daemon=True)
  thread.start()
  try:
    url = f"http://127.0.0.1:{server.server_port}"
    with urllib.request.urlopen(f"{url}/api/studies", timeout=30) as response:
      studies = json.load(response)["study_summaries"]
    (entry,) = [s for s in studies if s["study_name"] == "sweep"]
    with urllib.request.urlopen(f"{url}/api/studies/{entry['study_id']}", timeout=30) as response:
      detail = json.load(response)
  finally:
    server.shutdown()
  trials = detail["trials"]
  assert len(trials) == 6
  assert {t["state"] for t in trials} == {"Pruned", "Complete"}
  assert all(t["intermediate_values"] for t in trials)
  assert {p["name"] for t in trials for p in t["params"]} == {"learning_rate", "momentum"}


# -- Killed and resumed, and two runs on one study -----------------------------------------

SCRIPT = pathlib.Path(__file__).parent / "sweep_run.py"


def _run(workdir, out, *extra):
  return subprocess.run([sys.executable, str(SCRIPT), f"--workdir={workdir}", f"--out={out}",
                         "--scheduler=study", *extra], capture_output=True, text=True,
                        timeout=300)


def _trials(path):
  study = optuna.load_study(study_name="sweep", storage=_journal(path))
  return [(t.number, t.state.name, t.params, t.intermediate_values, t.value)
          for t in study.get_trials()]


def test_a_study_killed_evaluations_after_its_checkpoint_replays_them_exactly(tmp_path):
  # The checkpoint of step 2 only; killed after the choices of step 8, so the restart
  # replays three evaluations (4, 6, 8) holding prunes at ages 2 and 4, a completion,
  # refills and freezes, each where the uninterrupted run made it.
  straight = _run(tmp_path / "straight", tmp_path / "straight.npz")
  assert straight.returncode == 0, straight.stderr[-3000:]
  killed = _run(tmp_path / "work", tmp_path / "final.npz", "--kill_after_choices_at=8",
                "--save_at=2")
  assert killed.returncode == -9, killed.stderr[-3000:]
  resumed = _run(tmp_path / "work", tmp_path / "final.npz", "--save_at=2")
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "Resuming at step 2" in resumed.stderr
  a = json.loads((tmp_path / "straight" / "sweep.json").read_text())
  b = json.loads((tmp_path / "work" / "sweep.json").read_text())
  replayed = [e for e in a["events"] if 2 < e["step"] <= 8]
  assert {e["event"] for e in replayed} == {"stopped", "completed", "refill", "freeze"}
  assert {e.get("age") for e in replayed if e["event"] == "stopped"} == {2, 4}
  # The trials asked after the checkpoint and before the kill go on in their slots (not
  # asked again); the ones asked after the restart are the uninterrupted run's.
  assert "takes back trial" in resumed.stderr
  want = _trials(tmp_path / "straight" / "study.journal")
  got = _trials(tmp_path / "work" / "study.journal")
  assert got == want and len(want) == 10
  assert b["trials"] == a["trials"]
  assert any(r["start"] > 8 for r in a["trials"]) or any(r["end"] > 8 for r in a["trials"])
  assert b["events"] == a["events"]
  x, y = np.load(tmp_path / "straight.npz"), np.load(tmp_path / "final.npz")
  assert set(x) == set(y)
  for key in x:
    np.testing.assert_array_equal(x[key], y[key], err_msg=key)  # Bit for bit.


def test_a_study_killed_after_its_choices_resumes_with_the_same_trials(tmp_path):
  straight = _run(tmp_path / "straight", tmp_path / "straight.npz")
  assert straight.returncode == 0, straight.stderr[-3000:]
  killed = _run(tmp_path / "work", tmp_path / "final.npz", "--kill_after_choices_at=4")
  assert killed.returncode == -9, killed.stderr[-3000:]
  resumed = _run(tmp_path / "work", tmp_path / "final.npz")
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "Resuming at step 2" in resumed.stderr
  # The trials asked at step 4, after the checkpoint and before the kill, go on in their
  # slots (not asked again); the ones asked after the restart are the uninterrupted run's.
  assert "takes back trial" in resumed.stderr
  want = _trials(tmp_path / "straight" / "study.journal")
  got = _trials(tmp_path / "work" / "study.journal")
  assert got == want and len(want) == 10
  a = json.loads((tmp_path / "straight" / "sweep.json").read_text())
  b = json.loads((tmp_path / "work" / "sweep.json").read_text())
  assert b["trials"] == a["trials"]
  assert any(r["start"] > 4 for r in a["trials"])  # Trials were asked after the restart.
  assert [(e["step"], e["event"], e["slot"]) for e in b["events"]] == [
      (e["step"], e["event"], e["slot"]) for e in a["events"]]
  x, y = np.load(tmp_path / "straight.npz"), np.load(tmp_path / "final.npz")
  for key in x:
    np.testing.assert_array_equal(x[key], y[key], err_msg=key)  # Bit for bit.


def test_two_runs_on_one_study_split_its_trials(tmp_path):
  storage = tmp_path / "shared" / "study.journal"
  runs = [subprocess.Popen([sys.executable, str(SCRIPT), f"--workdir={tmp_path / name}",
                            f"--out={tmp_path / name}.npz", "--scheduler=study",
                            f"--storage={storage}"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True) for name in ("a", "b")]
  outputs = [run.communicate(timeout=300) for run in runs]
  for run, (_, err) in zip(runs, outputs, strict=True):
    assert run.returncode == 0, err[-3000:]
  study = optuna.load_study(study_name="sweep", storage=_journal(storage))
  trials = study.get_trials()
  # Each trial asked once, by one run; every trial finished; each run's records are its own.
  by_run = {name: {r["trial"] for r in json.loads(
      (tmp_path / name / "sweep.json").read_text())["trials"]} for name in ("a", "b")}
  assert not by_run["a"] & by_run["b"] and by_run["a"] and by_run["b"]
  assert by_run["a"] | by_run["b"] == {t.number for t in trials}
  assert 10 <= len(trials) <= 11  # n_trials; at most one more asked at the same moment.
  assert {t.state.name for t in trials} <= {"COMPLETE", "PRUNED"}
  for t in trials:
    owner = t.user_attrs["sweep"]["run"]
    assert t.number in by_run[pathlib.Path(owner).name]
  # The study's best is exported by the run that trained it, and named in the study.
  best = study.best_trial
  owner = pathlib.Path(best.user_attrs["sweep"]["run"]).name
  assert study.user_attrs["sweep_best"] == {"trial": best.number,
                                            "run": str(tmp_path / owner),
                                            "checkpoint": str(tmp_path / owner / "sweep_best")}
  config = json.loads((tmp_path / owner / "sweep_best_config.json").read_text())
  assert config["learning_rate"] == pytest.approx(best.params["learning_rate"])
  other = "b" if owner == "a" else "a"
  mine = tmp_path / other / "sweep_best_config.json"
  assert not mine.exists() or json.loads(mine.read_text())["learning_rate"] != (
      pytest.approx(best.params["learning_rate"]))


# -- The sampler's draws per trial ---------------------------------------------------------

def test_a_restarted_sampler_asks_what_the_uninterrupted_one_asked():
  space = study_lib.distributions({"learning_rate": ("log", 1e-4, 1.0),
                                   "momentum": ("float", 0.0, 0.99)})

  def run(restart_at):
    study = optuna.create_study(sampler=study_lib.trial_seeded("tpe", 3))
    asked = []
    for i in range(14):
      if i == restart_at:  # A new process: a new sampler object, the same study.
        study.sampler = study_lib.trial_seeded("tpe", 3)
      trial = study.ask(space)
      asked.append(trial.params)
      study.tell(trial, (np.log10(trial.params["learning_rate"]) + 2) ** 2)
    return asked

  straight = run(None)
  assert run(12) == straight  # Past TPE's 10 random trials: the model's draws too.
  assert len({p["learning_rate"] for p in straight}) == 14
  other = optuna.create_study(sampler=study_lib.trial_seeded("tpe", 4))
  assert other.ask(space).params != straight[0]  # The seed matters.


@pytest.mark.parametrize("name, prunes", [("median", True), ("successive_halving", True),
                                           ("hyperband", None), ("halving", True),
                                           ("none", False)])
def test_each_pruner_judges_a_trial_by_its_own_steps(name, prunes):
  # Trials of 6 steps reporting every 2 (the first rung); 4 good ones ran to the end.
  config = cnn_config(**{**STUDY, "sweep.study.pruner": name, "sweep.halving.rungs": (),
                         "sweep.study.startup_trials": 2, "sweep.halving.reduction_factor": 2})
  pruner = study_lib.make_pruner(config, budget=6)
  study = optuna.create_study(direction="minimize", pruner=pruner)
  for value in (0.1, 0.2, 0.3, 0.4):
    trial = study.ask()
    for age in (2, 4, 6):  # As the program does: each report judged (SH records rungs).
      trial.report(value, age)
      trial.should_prune()
    study.tell(trial, value)
  bad = study.ask()
  bad.report(5.0, 2)
  judged = bool(bad.should_prune())
  if prunes is not None:
    assert judged is prunes
  assert type(study.pruner).__name__ == {
      "median": "MedianPruner", "successive_halving": "SuccessiveHalvingPruner",
      "hyperband": "HyperbandPruner", "halving": "AshaPruner", "none": "NopPruner"}[name]


@pytest.mark.parametrize("name", ["median", "successive_halving", "hyperband", "halving"])
def test_each_pruner_prunes_first_at_its_documented_rung(name):
  # An evaluation every step; the first rung halving.min_steps=4: no trial is pruned at an
  # age below it, and a trial far behind four completed ones is pruned at it.
  config = cnn_config(**{**STUDY, "eval_every_steps": 1, "sweep.study.pruner": name,
                         "sweep.halving.rungs": (), "sweep.halving.min_steps": 4,
                         "sweep.study.startup_trials": 2, "sweep.halving.reduction_factor": 2})
  study = optuna.create_study(direction="minimize",
                              pruner=study_lib.make_pruner(config, budget=8))
  for value in (0.1, 0.2, 0.3, 0.4):
    trial = study.ask()
    for age in range(1, 9):
      trial.report(value, age)
      trial.should_prune()
    study.tell(trial, value)
  bad = study.ask()
  first = None
  for age in range(1, 9):
    bad.report(5.0, age)
    if bad.should_prune():
      first = age
      break
  if name == "hyperband":  # Its bracket decides the rung; never before the first.
    assert first is None or first >= 4
  else:
    assert first == 4


# -- Refusals -------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, message", [
    ({"sweep.study.space.learning_rate": ("log", 0.0, 0.1)},
     r"space.learning_rate=\('log', 0.0, 0.1\): a log-uniform range must be above 0"),
    ({"sweep.study.space.momentum": ("float", 0.9, 0.1)},
     r"space.momentum=\('float', 0.9, 0.1\): low 0.9 is above high 0.1"),
    ({"sweep.study.space.momentum": ("float", 0.0, 1.5)}, r"momentum=1.5 is out of range"),
    ({"sweep.study.space.momentum": ("normal", 0.0, 0.9)}, r"the kind 'normal' is not one of"),
    ({"sweep.study.space.learning_rate": ("log", 1e-3, 0.1), "sweep.study.sampler": "bayes"},
     r"sampler='bayes' is not a sampler Optuna has; one of \['cmaes', 'gp', 'qmc', 'random'"),
    ({"sweep.study.space.learning_rate": ("log", 1e-3, 0.1), "sweep.study.pruner": "asha"},
     r"pruner='asha' is not a pruner Optuna has here; one of \('median', 'successive_halving'"),
    ({"sweep.study.space.learning_rate": ("log", 1e-3, 0.1),
      "sweep.grid.learning_rate": (0.1, 0.2)}, r"cannot be combined with \['sweep.grid.learning"),
    ({"sweep.study.space.warmup_steps": ("float", 0.0, 10.0)}, r"use \('int', low, high\)"),
    ({"sweep.study.space.b1": ("categorical", "high")}, r"at least one number"),
])
def test_a_study_that_cannot_work_is_refused_naming_the_field(overrides, message):
  with pytest.raises(ValueError, match=message):
    check_config(cnn_config(**overrides))


def test_a_distribution_on_what_changes_the_program_is_refused_saying_why():
  config = cnn_config()
  config.sweep.study.space.unlock()
  config.sweep.study.space.num_layers = ("int", 1, 4)
  with pytest.raises(ValueError, match=r"space.num_layers=.*cannot be swept.*one compiled "
                                       r"program.*a width, the number of layers"):
    check_config(config)
  error = unknown_override(cnn_config(), ["--config.sweep.study.space.dropout_rate=(0.1,)"])
  assert "cannot be swept" in str(error) and "dropout rate" in str(error)


def test_a_storage_that_cannot_be_opened_is_named_with_the_databases_error(tmp_path):
  url = f"sqlite:///{tmp_path}/no/such/dir/study.db"
  trainer = FlaxStyleTrainer(cnn_config(**{**STUDY, "sweep.study.storage": url}))
  with pytest.raises(study_lib.StudyError, match=r"storage='sqlite:///.*' cannot be opened: "
                                                 r"OperationalError.*unable to open") as e:
    trainer.fit(lambda s: image_batches(2, 16), num_steps=6, workdir=str(tmp_path / "w"),
                eval_batches=lambda: image_batches(1, 16))
  assert e.value.__cause__ is not None  # The database's own error, kept.


@pytest.mark.parametrize("change, message", [
    ({"sweep.mode": "max"}, r"was created to minimize, but config.sweep.mode='max'"),
    ({"sweep.study.space.momentum": ("float", 0.0, 0.5)}, r"was created with the search space"),
])
def test_resuming_a_study_made_for_another_space_or_direction_is_refused(tmp_path, change,
                                                                         message):
  storage = str(tmp_path / "study.journal")
  study_lib.open_study(cnn_config(**{**STUDY, "sweep.study.storage": storage}), None,
                       pruner=optuna.pruners.NopPruner())
  trainer = FlaxStyleTrainer(cnn_config(**{**STUDY, "sweep.study.storage": storage, **change}))
  with pytest.raises(study_lib.StudyError, match=message):
    trainer.fit(lambda s: image_batches(2, 16), num_steps=6, workdir=str(tmp_path / "w"),
                eval_batches=lambda: image_batches(1, 16))
  assert not (tmp_path / "w" / "checkpoints").exists()
