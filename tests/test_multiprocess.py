"""Multi-process runs: 2 real processes x 4 CPU devices (gloo) against 1 process x 8.

One `python -m trainer.distributed.launch --num_processes 2` run (module fixture) trains
every case of `tests/multiprocess_cases.py` (jit data parallel with a Linen
BatchNorm ResNet, an NNX BatchNorm+dropout ensemble with members spread over
both processes, the same ensemble fed from a split on the devices two steps a
call, the same layout as a sweep of 2 learning rates x 2 seeds, the FSDP
transformer LM) and resumes a checkpoint that one
process wrote under `single_device`. The tests compare what it wrote with
the same runs in this process and restore its checkpoints here, under the
strategy that wrote them and under another.
"""

import glob
import json
import os
import pathlib
import subprocess
import sys

import corpus_files
import jax
import multiprocess_cases as cases
import numpy as np
import process_cache
import pytest

from strategies import PmapEnsemble, ShardedDataParallel, SingleDevice
from trainer.checkpoint import Checkpointer
from trainer.writers import JSONL_NAME

ROOT = pathlib.Path(__file__).resolve().parents[1]


def launch(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
  env = process_cache.launched_env()  # Each process makes its own 4 devices.
  return subprocess.run(
      [sys.executable, "-m", "trainer.distributed.launch", "--num_processes", "2", *args],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module", autouse=True)
def corpus(tmp_path_factory):
  """The `lm_corpus` case's files, named to every process by the environment."""
  root = tmp_path_factory.mktemp("corpus")
  corpus_files.write_corpus(root)
  saved = os.environ.get(cases.CORPUS_ENV)
  os.environ[cases.CORPUS_ENV] = str(root)
  yield root
  if saved is None:
    os.environ.pop(cases.CORPUS_ENV, None)
  else:
    os.environ[cases.CORPUS_ENV] = saved


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory, corpus):
  """Root of the 2-process runs; `resume` started from a 1-process single-device checkpoint."""
  root = tmp_path_factory.mktemp("two_processes")
  cases.run("resnet_dp", str(root / "resume"), num_steps=cases.SAVE_EVERY,
            strategy=SingleDevice())
  result = launch("tests/multiprocess_run.py", f"--root={root}",
                  "--cases=" + ",".join(cases.CASES + cases.ELASTIC_CASES) + ",resnet_dp@resume")
  assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
  return root


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, corpus):
  """The same runs in this process (8 devices), keyed by case: (trainer, result, workdir)."""
  root = tmp_path_factory.mktemp("one_process")
  runs = {}
  for case in cases.CASES:
    trainer, result = cases.run(case, str(root / case))
    runs[case] = (trainer, result, root / case)
  return runs


def saved(root: pathlib.Path, case_dir: str):
  out = root / case_dir / "out"
  return dict(np.load(out / "state.npz")), json.loads((out / "result.json").read_text())


def assert_same_state(got: dict, want: dict, rtol=2e-5, atol=2e-6):
  assert got.keys() == want.keys()
  for key in want:
    np.testing.assert_allclose(got[key], want[key], rtol=rtol, atol=atol, err_msg=key)


def train_losses(workdir: pathlib.Path) -> list[tuple[int, float]]:
  lines = [json.loads(line) for line in (workdir / JSONL_NAME).read_text().splitlines()]
  return [(r["step"], r["loss"]) for r in lines if r["split"] == "train"]


def test_launched_processes_make_their_devices_and_compile_as_the_tests_do(monkeypatch):
  # The 1-process runs they are held to compiled with the tests' options (conftest.py).
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8 "
                                  "--xla_backend_optimization_level=1 --xla_dump_to=/x")
  monkeypatch.setenv("TRAINER_X", "1")
  env = process_cache.launched_env(drop=("TRAINER_X",), PYTHONPATH="/p")
  assert env["XLA_FLAGS"] == "--xla_backend_optimization_level=1 --xla_dump_to=/x"
  assert "TRAINER_X" not in env and env["PYTHONPATH"] == "/p"
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  assert "XLA_FLAGS" not in process_cache.launched_env()


@pytest.mark.parametrize("case", cases.CASES)
def test_two_processes_equal_one(case, two_processes, one_process):
  state, meta = saved(two_processes, case)
  trainer, result, workdir = one_process[case]
  # A halving sweep runs until its trials have stopped or completed their NUM_STEPS.
  assert result.step == cases.NUM_STEPS or case == "halving_ensemble"
  assert (meta["processes"], meta["devices"], meta["step"]) == (2, 8, result.step)
  assert_same_state(state, cases.flat(trainer.strategy.to_canonical(result.state)))
  assert meta["final_eval"].keys() == result.final_eval.keys()
  for name, value in result.final_eval.items():
    np.testing.assert_allclose(meta["final_eval"][name], value, rtol=1e-5, atol=1e-6,
                               err_msg=name)
  # metrics.jsonl: one writer (process 0), the same losses step by step.
  two, one = train_losses(two_processes / case), train_losses(workdir)
  assert [s for s, _ in two] == [s for s, _ in one] == list(range(1, result.step + 1))
  np.testing.assert_allclose([v for _, v in two], [v for _, v in one], rtol=1e-5)
  assert len(list((two_processes / case).glob("events.out.tfevents.*"))) == 1


def test_a_halving_sweep_makes_the_same_choices_on_two_processes(two_processes, one_process):
  # 4 slots of 2 data devices each, spread over both processes; slots refilled at step 2.
  two = json.loads((two_processes / "halving_ensemble" / "sweep.json").read_text())
  one = json.loads((one_process["halving_ensemble"][2] / "sweep.json").read_text())
  assert [e["event"] for e in one["events"]].count("refill") == 2
  assert two["events"] == one["events"]
  assert [(r["trial"], r["slot"], r["start"], r["end"], r["status"]) for r in two["trials"]] == [
      (r["trial"], r["slot"], r["start"], r["end"], r["status"]) for r in one["trials"]]


def _restore(case: str, directory: pathlib.Path, strategy=None) -> dict:
  trainer = cases.trainer_of(case, strategy)
  checkpointer = Checkpointer(directory / "checkpoints")
  try:
    ended = json.loads((directory / "out" / "result.json").read_text())["step"]
    assert checkpointer.latest_step() == ended
    state = trainer.restore_checkpoint(checkpointer, cases.global_batch(case, 0))
  finally:
    checkpointer.close()
  return cases.flat(trainer.strategy.to_canonical(state))


def _other_strategy(case: str):
  """A layout other than the one that wrote the case's checkpoint."""
  if case == "resnet_dp":
    return SingleDevice()
  if case in ("nnx_ensemble", "device_ensemble", "sweep_ensemble", "halving_ensemble"):
    return PmapEnsemble(num_members=4, devices=jax.devices()[:4])
  return ShardedDataParallel((2, 4), ("data", "model"), (("batch", "data"),))  # Unsharded LM.


@pytest.mark.parametrize("case", cases.CASES)
def test_two_process_checkpoint_restores_in_one_process(case, two_processes):
  state, _ = saved(two_processes, case)
  assert_same_state(_restore(case, two_processes / case), state, rtol=0, atol=0)
  assert_same_state(_restore(case, two_processes / case, _other_strategy(case)), state,
                    rtol=0, atol=0)


def test_one_process_checkpoint_resumes_on_two_processes(two_processes, one_process):
  """Written at step 2 by `single_device` in one process, resumed by 2 x 4 jit DP to step 4."""
  state, meta = saved(two_processes, "resume")
  assert meta["step"] == cases.NUM_STEPS
  trainer, result, _ = one_process["resnet_dp"]
  assert_same_state(state, cases.flat(trainer.strategy.to_canonical(result.state)))
  steps = [s for s, _ in train_losses(two_processes / "resume")]
  assert steps == list(range(1, cases.NUM_STEPS + 1))  # 1-2 from one process, 3-4 from two.


def test_a_corpus_checkpoint_of_two_processes_holds_every_lane_and_resumes_on_one(
    two_processes, one_process, tmp_path):
  """Each process read its 2 of the 4 lanes; the checkpoint holds all 4 (gathered at the
  save); one process of 8 devices resumes it to step 8 as a run of its own does."""
  import shutil

  from trainer.data import lm
  checkpoints = two_processes / "lm_corpus" / "checkpoints"
  layout = json.loads((checkpoints / str(cases.NUM_STEPS) / "layout" / "metadata").read_text())
  data = layout["data"]
  assert data[lm.LANES_KEY] == 4 and sorted(data[lm.STATES_KEY]) == ["0", "1", "2", "3"]
  assert lm.PROCESS_KEY not in data
  workdir = tmp_path / "resumed"
  shutil.copytree(checkpoints, workdir / "checkpoints")
  trainer, resumed = cases.run("lm_corpus", str(workdir), 2 * cases.NUM_STEPS)
  _, whole = cases.run("lm_corpus", str(tmp_path / "whole"), 2 * cases.NUM_STEPS)
  assert resumed.step == whole.step == 2 * cases.NUM_STEPS
  assert_same_state(cases.flat(trainer.strategy.to_canonical(resumed.state)),
                    cases.flat(trainer.strategy.to_canonical(whole.state)))
  # The resumed run trained on the same batches: its losses after step 4 are the whole run's.
  after = [(s, v) for s, v in train_losses(workdir) if s > cases.NUM_STEPS]
  expect = [(s, v) for s, v in train_losses(tmp_path / "whole") if s > cases.NUM_STEPS]
  assert [s for s, _ in after] == [s for s, _ in expect] == list(range(5, 9))
  np.testing.assert_allclose([v for _, v in after], [v for _, v in expect], rtol=1e-5)


# -- Elastic resume: saved on 2 processes x 4 devices, resumed on 1 x 8 and 1 x 4 ---------------


def trained_ids(examples: dict[str, np.ndarray], num_steps: int) -> list[list[int]]:
  """The example ids each training step saw, from an `ExampleLog`'s record (one member's)."""
  count, first, last = (np.asarray(examples[k]) for k in ("count", "first", "last"))
  steps = [sorted(np.flatnonzero(first == s).tolist()) for s in range(1, num_steps + 1)]
  for s in range(1, num_steps + 1):  # Second sightings (a second epoch) at their last step.
    steps[s - 1] += np.flatnonzero((count == 2) & (last == s)).tolist()
  assert count.max() <= 2
  return [sorted(ids) for ids in steps]


def members_examples(trainer, result) -> list[dict[str, np.ndarray]]:
  examples = jax.device_get(trainer.strategy.to_canonical(result.state.model_state)["examples"])
  if not trainer.strategy.checkpoint_layout()["num_members"]:
    return [examples]
  return [jax.tree.map(lambda x, i=i: x[i], examples) for i in range(4)]


@pytest.mark.parametrize("case", cases.ELASTIC_CASES)
def test_a_grain_run_saved_on_two_processes_resumes_on_one_process_of_8_and_of_4_devices(
    case, two_processes, tmp_path, caplog):
  import shutil

  saved_at = cases.NUM_STEPS
  _, meta = saved(two_processes, case)
  assert (meta["processes"], meta["step"]) == (2, saved_at)
  checkpointer = Checkpointer(two_processes / case / "checkpoints")
  layout = checkpointer.layout(saved_at)
  checkpointer.close()
  assert layout["data"] == {"global_batch": saved_at}
  assert layout["shape"] == {"processes": 2, "devices": 8,
                             "data_shards": 2 if case == "grain_dp" else 1}
  # The global order, as one process reads it: the ids of each step's batch.
  stream = cases.grain_batches((0, 1))()
  order = [sorted(next(stream)["id"].tolist()) for _ in range(cases.ELASTIC_STEPS)]
  for devices in (8, 4):
    strategy = cases.elastic_strategy(case, devices)
    workdir = tmp_path / f"resumed_on_{devices}"
    shutil.copytree(two_processes / case / "checkpoints", workdir / "checkpoints")
    with caplog.at_level("INFO"):
      trainer, resumed = cases.run(case, str(workdir), cases.ELASTIC_STEPS, strategy=strategy)
    assert f"Resuming at step {saved_at}" in caplog.text
    assert "saved by 2 process(es), 8 devices" in caplog.text
    _, whole = cases.run(case, str(tmp_path / f"whole_on_{devices}"), cases.ELASTIC_STEPS,
                         strategy=strategy)
    # Steps 1-4 on two processes, 5-8 here: each saw its global batch; the first epoch
    # (steps 1-5) saw every example once, steps 6-8 the start of the second epoch.
    for examples in members_examples(trainer, resumed):
      ids = trained_ids(examples, cases.ELASTIC_STEPS)
      assert ids == order
      assert sorted(sum(ids[:5], [])) == list(range(cases.NUM_EXAMPLES))
      assert int(examples["t"]) == cases.ELASTIC_STEPS
    assert_same_state(cases.flat(trainer.strategy.to_canonical(resumed.state)),
                      cases.flat(trainer.strategy.to_canonical(whole.state)))


# -- Starting --------------------------------------------------------------------------------


def test_fresh_two_process_runs_start_every_time_however_their_directories_are_given(tmp_path):
  """A fresh run's processes enter the same barriers: orbax's manager (made when a process
  finds the checkpoint directory) is made by all or by none, decided from what all of them
  see, so one process never waits in its barrier while another is in the first step."""
  import fresh_start_run as fresh
  rounds = 2
  for r in range(rounds):
    (tmp_path / f"existing-{r}").mkdir()
  result = launch("tests/fresh_start_run.py", f"--root={tmp_path}", f"--rounds={rounds}")
  assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
  for r in range(rounds):
    for way in fresh.WAYS:
      for process in (0, 1):
        assert f"[process {process}] {way}-{r}: step {fresh.NUM_STEPS}" in result.stdout
      checkpointer = Checkpointer(tmp_path / f"{way}-{r}" /
                                  ("checkpoints" if way == "workdir" else ""))
      try:
        assert checkpointer.all_steps() == list(range(1, fresh.NUM_STEPS + 1)), way
      finally:
        checkpointer.close()
  assert "Watchdog" not in result.stdout  # The first step's one-time work is not a hang.


# -- Preemption and failures -------------------------------------------------------------------


def start(root: pathlib.Path, *args: str, launcher: tuple[str, ...] = ()) -> subprocess.Popen:
  env = process_cache.launched_env()
  return subprocess.Popen(
      [sys.executable, "-m", "trainer.distributed.launch", "--num_processes", "2", *launcher,
       "tests/multiprocess_run.py", f"--root={root}", *args],
      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def process_pid(launcher: subprocess.Popen, process_id: int) -> int:
  """The pid of the launcher's child with JAX_PROCESS_ID=process_id."""
  children = pathlib.Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text()
  for pid in map(int, children.split()):
    environ = pathlib.Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    if f"JAX_PROCESS_ID={process_id}".encode() in environ:
      return pid
  raise AssertionError(f"no child with JAX_PROCESS_ID={process_id} in {children!r}")


def wait_for_step(workdir: pathlib.Path, launcher: subprocess.Popen, step: int,
                  timeout: float = 240) -> None:
  """Waits until metrics.jsonl shows training step `step` (the processes are in the loop)."""
  import time
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    assert launcher.poll() is None, launcher.stdout.read()[-5000:]
    jsonl = workdir / JSONL_NAME
    if jsonl.exists() and any(s >= step for s, _ in train_losses(workdir)):
      return
    time.sleep(0.2)
  launcher.kill()
  raise AssertionError(f"no train step {step} within {timeout} s")


def test_sigterm_to_one_process_stops_all_at_one_step_with_a_checkpoint(tmp_path):
  import signal
  launcher = start(tmp_path, "--cases=lm_fsdp", "--num_steps=400", "--step_seconds=0.05")
  wait_for_step(tmp_path / "lm_fsdp", launcher, 3)
  os.kill(process_pid(launcher, 1), signal.SIGTERM)  # Only process 1 is told.
  output, _ = launcher.communicate(timeout=240)
  assert launcher.returncode == 0, output[-6000:]
  stops = [line for line in output.splitlines() if "lm_fsdp: step" in line]
  assert len(stops) == 2, output[-3000:]
  steps = {line.split("[process ")[1][0]: line.split("lm_fsdp: ")[1] for line in stops}
  assert steps["0"] == steps["1"], stops  # Both stopped after the same step ...
  _, meta = saved(tmp_path, "lm_fsdp")
  assert meta["stopped_by"] == "SIGTERM" and 3 < meta["step"] < 400
  assert steps["0"] == f"step {meta['step']}, stopped by SIGTERM"
  checkpointer = Checkpointer(tmp_path / "lm_fsdp" / "checkpoints")
  try:
    assert checkpointer.latest_step() == meta["step"]  # ... and saved it together.
  finally:
    checkpointer.close()


def run_as_slurm_tasks(root: pathlib.Path, *args: str) -> list[str]:
  """Runs tests/multiprocess_run.py as the 2 tasks of a SLURM job step on this machine."""
  from trainer.distributed.launch import free_port
  port, procs = str(free_port()), []
  for task in range(2):
    env = process_cache.launched_env()
    env.update(SLURM_JOB_ID="4242", SLURM_STEP_NODELIST="localhost", SLURM_NTASKS="2",
               SLURM_PROCID=str(task), SLURM_LOCALID=str(task), SLURM_STEP_NUM_NODES="1",
               JAX_COORDINATOR_PORT=port, TRAINER_DISTRIBUTED="auto")
    procs.append(subprocess.Popen(
        [sys.executable, "tests/multiprocess_run.py", f"--root={root}", *args], cwd=ROOT,
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
  outputs = [p.communicate(timeout=240)[0] for p in procs]
  assert [p.returncode for p in procs] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
  return outputs


def test_sigkill_of_one_process_then_restart_resumes_exactly(tmp_path, one_process):
  import signal
  num_steps = cases.NUM_STEPS
  launcher = start(tmp_path, "--cases=lm_fsdp", f"--num_steps={num_steps}",
                   "--step_seconds=1")  # Step 4 cannot end within a second of step 3's log.
  wait_for_step(tmp_path / "lm_fsdp", launcher, cases.SAVE_EVERY + 1)
  os.kill(process_pid(launcher, 1), signal.SIGKILL)
  output, _ = launcher.communicate(timeout=120)
  assert launcher.returncode == 128 + signal.SIGKILL, output[-4000:]
  assert "process 1 exited with status -9; stopping the other processes" in output
  assert not (tmp_path / "lm_fsdp" / "out").exists()
  checkpointer = Checkpointer(tmp_path / "lm_fsdp" / "checkpoints")
  try:
    killed_at = checkpointer.latest_step()
  finally:
    checkpointer.close()
  assert killed_at == cases.SAVE_EVERY

  # The restart is a SLURM job step: no launcher, `TRAINER_DISTRIBUTED=auto`, and the
  # variables `srun` gives each task, from which jax.distributed finds the rest itself.
  outputs = run_as_slurm_tasks(tmp_path, "--cases=lm_fsdp", f"--num_steps={num_steps}")
  state, meta = saved(tmp_path, "lm_fsdp")
  assert meta["processes"] == 2, outputs
  assert meta["step"] == num_steps and meta["stopped_by"] is None
  trainer, reference, _ = one_process["lm_fsdp"]  # The same run, uninterrupted, in 1 process.
  assert_same_state(state, cases.flat(trainer.strategy.to_canonical(reference.state)))


def test_the_launcher_restarts_a_killed_process_and_the_job_finishes_exactly(tmp_path,
                                                                            one_process):
  """`--max_restarts`: SIGKILL one worker mid-run; every process starts again from the latest
  complete checkpoint, and the job ends by itself with the uninterrupted run's state."""
  import signal
  launcher = start(tmp_path, "--cases=lm_fsdp", f"--num_steps={cases.NUM_STEPS}",
                   "--step_seconds=1", launcher=("--max_restarts", "2"))
  wait_for_step(tmp_path / "lm_fsdp", launcher, cases.SAVE_EVERY + 1)
  os.kill(process_pid(launcher, 1), signal.SIGKILL)
  output, _ = launcher.communicate(timeout=300)
  assert launcher.returncode == 0, output[-6000:]
  assert ("[launch] restart 1 of 2: process 1 failed with status -9; starting all 2 "
          "processes again from the latest complete checkpoint.") in output, output[-4000:]
  steps = [s for s, _ in train_losses(tmp_path / "lm_fsdp")]
  assert sorted(set(steps)) == list(range(1, cases.NUM_STEPS + 1))
  assert steps.count(cases.SAVE_EVERY + 1) == 2, steps  # Redone from checkpoint SAVE_EVERY.
  state, meta = saved(tmp_path, "lm_fsdp")
  assert meta["step"] == cases.NUM_STEPS and meta["stopped_by"] is None
  trainer, reference, _ = one_process["lm_fsdp"]
  assert_same_state(state, cases.flat(trainer.strategy.to_canonical(reference.state)))


def test_the_launcher_gives_up_after_its_restarts(tmp_path):
  script = tmp_path / "fails.py"
  script.write_text("import os, sys\nprint('attempt', os.environ['TRAINER_RESTART'])\n"
                    "sys.exit(3 if os.environ['JAX_PROCESS_ID'] == '1' else 0)\n")
  result = subprocess.run(
      [sys.executable, "-m", "trainer.distributed.launch", "--num_processes", "2",
       "--max_restarts", "1", str(script)], cwd=ROOT, capture_output=True, text=True,
      timeout=60)
  assert result.returncode == 3, result.stdout
  assert "[launch] restart 1 of 1: process 1 failed with status 3" in result.stdout
  assert "no restarts are left (1 used); giving up." in result.stdout
  assert sorted(line.split("] ")[1] for line in result.stdout.splitlines()
                if "attempt" in line) == ["attempt 0", "attempt 0", "attempt 1", "attempt 1"]


# -- Settings and errors, in this process ----------------------------------------------------


@pytest.mark.parametrize("env,message", [
    ({"JAX_PROCESS_ID": "0"}, r"JAX_PROCESS_ID is set but JAX_NUM_PROCESSES is not"),
    ({"JAX_NUM_PROCESSES": "two", "JAX_PROCESS_ID": "0"}, r"JAX_NUM_PROCESSES='two' must be an"),
    ({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2"}, r"JAX_PROCESS_ID=2 must be set to an "
                                                         r"integer in \[0, 2\)"),
    ({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}, r"JAX_COORDINATOR_ADDRESS \(host:port "
                                                         r"of process 0\) must be set"),
    ({"TRAINER_DISTRIBUTED": "yes"}, r"TRAINER_DISTRIBUTED='yes' must be 'auto'"),
])
def test_malformed_distributed_settings_name_the_variable(monkeypatch, env, message):
  from trainer.distributed import devices
  for name in ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "JAX_COORDINATOR_ADDRESS",
               "TRAINER_DISTRIBUTED"):
    monkeypatch.delenv(name, raising=False)
  for name, value in env.items():
    monkeypatch.setenv(name, value)
  with pytest.raises(ValueError, match=message):
    devices.distributed_settings()


def test_the_environment_names_the_run(monkeypatch):
  from trainer.distributed import devices
  for name in ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "JAX_COORDINATOR_ADDRESS",
               "TRAINER_DISTRIBUTED"):
    monkeypatch.delenv(name, raising=False)
  assert devices.distributed_settings() is None
  monkeypatch.setenv("TRAINER_DISTRIBUTED", "auto")
  assert devices.distributed_settings() == {}  # jax.distributed.initialize() detects the rest.
  monkeypatch.delenv("TRAINER_DISTRIBUTED")
  monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
  monkeypatch.setenv("JAX_PROCESS_ID", "1")
  monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "host0:1234")
  assert devices.distributed_settings() == dict(coordinator_address="host0:1234",
                                                num_processes=2, process_id=1)


def test_one_process_strategies_are_refused_on_several_and_errors_name_the_process(monkeypatch):
  from strategies import create_strategy
  from trainer.distributed import devices
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(jax, "process_index", lambda: 1)
  config = cases.config_of("resnet_dp")
  for name in ("single_device", "pmap_data_parallel", "pmap_ensemble"):
    config.strategy.name = name
    with pytest.raises(ValueError, match=rf"config.strategy.name='{name}' places everything on "
                                         r"the devices of one process, but this run has 2 "
                                         r"processes .* use one of \['sharded_data_parallel', "
                                         r"'sharded_ensemble'\]"):
      create_strategy(config)
  monkeypatch.setattr(jax.distributed, "is_initialized", lambda: True)
  with pytest.raises(ValueError) as error, devices.naming_the_process():
    raise ValueError("a bad batch")
  assert error.value.__notes__ == ["(raised in process 1 of 2)"]


def test_a_fault_schedule_under_restarts_ends_equal_to_the_uninterrupted_run(tmp_path):
  """The figure for the README: 2 processes under `--max_restarts 3` meet a SIGKILL, a
  corrupted latest checkpoint, a failed save (ENOSPC) and a loss spike (`tests/fault_run.py`),
  and the job ends by itself with the uninterrupted one-process run's state."""
  result = launch("--max_restarts", "3", "tests/fault_run.py", f"--root={tmp_path}",
                  timeout=480)
  output = result.stdout + result.stderr
  assert result.returncode == 0, output[-8000:]
  workdir = tmp_path / "spiky_mlp"
  faults = {
      "SIGKILL": "restart 1 of 3: process 1 failed with status -9",
      "corrupt checkpoint": "Checkpoint step 4 is unreadable",
      "failed save": "[Errno 28] No space left on device",
      "loss spike": "Loss spikes: 1 update(s) left out",
  }
  for fault, line in faults.items():
    assert line in output, (fault, output[-8000:])
  # The failed save leaves the other process in orbax's barrier: the watchdog ends the
  # hang (status 75) and the launcher restarts from the last complete checkpoint.
  slow = cases.config_of("spiky_mlp").watchdog_slow_seconds  # The limit checkpoints get.
  assert f"Watchdog: nothing finished for {slow:g} s in checkpoint" in output
  assert "failed with status 75" in output.split("restart 2 of 3")[1].split("\n")[0]
  assert "restart 3 of 3" not in output
  assert len(glob.glob(str(workdir / "checkpoints" / "4.corrupt-*"))) == 1  # Kept, renamed.
  records = [json.loads(line) for line in (workdir / JSONL_NAME).read_text().splitlines()]
  steps = [r["step"] for r in records if r["split"] == "train" and "loss" in r]
  assert sorted(set(steps)) == list(range(1, 13))  # No step missing from the record.
  redone = len(steps) - 12
  state, meta = saved(tmp_path, "spiky_mlp")
  assert meta["step"] == 12 and meta["processes"] == 2
  trainer, reference = cases.run("spiky_mlp", str(tmp_path / "reference"), 12)
  assert int(np.ravel(trainer.strategy.to_canonical(reference.state.spikes.skips))[0]) == 1
  assert_same_state(state, cases.flat(trainer.strategy.to_canonical(reference.state)))
  print(f"faults survived: {len(faults)} ({', '.join(faults)}); steps redone: {redone}; "
        f"steps lost, data lost: none")
