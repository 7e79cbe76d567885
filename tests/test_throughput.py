"""Runs that say how fast they are and where their time went, and a watchdog for hangs.

FLOPs per step are the step's matrix products, counted through scans and over the
models a strategy trains; MFU is the achieved FLOP/s over the device's peak; the loop's wall time
is split into categories that add up, carried over a resume; a hang ends the
process with the watchdog's status, its threads' stacks in the log and only
complete checkpoints on disk, and the same command then resumes exactly.
"""

import itertools
import json
import pathlib
import subprocess
import sys
import time
import types

import flax.linen as nn
import numpy as np
import pytest
from conftest import ALL_STRATEGIES, CNNTrainer, cnn_config, image_batches
from small_configs import tiny_lm_config

from trainer import throughput, writers
from trainer.checkpoint import Checkpointer
from trainer.language_model import LanguageModelTrainer, synthetic_token_batches
from trainer.loop import timing

HERE = pathlib.Path(__file__).resolve().parent


def _flops(overrides, trainer_cls=CNNTrainer, batch=None):
  trainer = trainer_cls(cnn_config(**overrides))
  batch = batch or image_batches(1, 16)[0]
  return trainer.fit([batch], num_steps=1).step_flops


class DenseOnly(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(10)(nn.relu(nn.Dense(256)(x.reshape((x.shape[0], -1)))))


class DenseTrainer(CNNTrainer):
  def build_model(self):
    return DenseOnly()


def test_a_dense_models_step_costs_what_its_matmuls_do():
  flops = _flops({"batch_size": 64}, DenseTrainer, image_batches(1, 64)[0])
  # Per example, 2 FLOPs a multiply-add: each weight forward and for its gradient, and the
  # second layer's weights once more for its input gradient (the images need none).
  first, second = 784 * 256, 256 * 10
  assert flops.total == 64 * 2 * (2 * first + 3 * second)
  assert flops.per_device == flops.total


@pytest.mark.parametrize("strategy,models", [("pmap_data_parallel", 1), ("pmap_ensemble", 8),
                                             ("sharded_ensemble", 4),
                                             ("sharded_data_parallel", 1)])
def test_flops_count_every_model_a_strategy_trains(strategy, models):
  one = _flops({}).total
  flops = _flops(ALL_STRATEGIES[strategy])
  assert flops.total == pytest.approx(models * one, rel=1e-9)
  assert flops.per_device == pytest.approx(flops.total / 8)


def test_a_scanned_models_flops_grow_with_its_layers():
  """The LM's blocks run in `nn.scan`: each layer counts (XLA's cost analysis counts a
  loop body once)."""
  def lm_flops(layers):  # What `fit` reports (FitResult.step_flops), without the step's compile.
    config = tiny_lm_config(**{"strategy.name": "single_device", "model.num_layers": layers})
    trainer = LanguageModelTrainer(config)
    batch = next(synthetic_token_batches(0, 16, 16, 32))
    state = trainer.init_state(batch)
    return throughput.StepFlops(trainer.compiled.train(state),
                                lambda: (state, trainer.strategy.put_batch(batch)),
                                num_devices=1).total

  one, two, three = (lm_flops(n) for n in (1, 2, 3))
  assert three - two == pytest.approx(two - one, rel=1e-9) and two > one


def test_mfu_is_the_achieved_flops_over_the_devices_peak(tmp_path, monkeypatch):
  monkeypatch.setattr(throughput, "peak_tflops", lambda device, dtype: 0.5)
  monkeypatch.setattr(throughput, "reports_flops", lambda device: True)  # As on a GPU.
  trainer = CNNTrainer(cnn_config(log_every_steps=2))
  writer = writers.create_writer(str(tmp_path))
  result = trainer.fit(image_batches(4, 16), num_steps=4, writer=writer)
  writer.close()
  records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  train = [r for r in records if r["split"] == "train"]
  assert [r["step"] for r in train] == [2, 4]
  for r in train:
    achieved = result.step_flops.per_device * r["steps_per_sec"] / 1e12
    assert r["tflops_per_device"] == pytest.approx(achieved, rel=1e-6)
    assert r["mfu"] == pytest.approx(achieved / 0.5, rel=1e-6)
    times = [v for k, v in r.items() if k.startswith("time_")]
    assert len(times) == len(timing.CATEGORIES) and sum(times) == pytest.approx(1.0)
    assert r["goodput"] == r["time_train"] > 0


def test_a_language_model_reports_tokens_per_second(tmp_path):
  config = tiny_lm_config(**{"strategy.name": "single_device", "log_every_steps": 2})
  writer = writers.create_writer(str(tmp_path))
  LanguageModelTrainer(config).fit(list(itertools.islice(synthetic_token_batches(
      0, 16, 16, 32), 2)), num_steps=2, writer=writer)
  writer.close()
  record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
  assert record["tokens_per_sec"] == pytest.approx(record["steps_per_sec"] * 16 * 16)


@pytest.mark.parametrize("kind,dtype,peak", [
    ("NVIDIA H100 80GB HBM3", "bfloat16", 989.4), ("NVIDIA H100 80GB HBM3", "float32", 494.7),
    ("NVIDIA H100 PCIe", "bfloat16", 756.5), ("NVIDIA H200", "float16", 989.4),
    ("NVIDIA A100-SXM4-80GB", "bfloat16", 312.0), ("TPU v5 lite", "bfloat16", 197.0),
    ("TPU v5p", "bfloat16", 459.0), ("Radeon 9000", "bfloat16", None)])
def test_device_peaks_come_from_the_table_by_kind_and_dtype(kind, dtype, peak):
  device = types.SimpleNamespace(platform="gpu", device_kind=kind)
  assert throughput.peak_tflops(device, dtype) == peak


def test_on_cpu_the_peak_is_measured_by_a_matmul():
  peak = throughput.peak_tflops(types.SimpleNamespace(platform="cpu"), "float32")
  assert 1e-4 < peak < 100


# -- Where the time went ---------------------------------------------------------------------


def test_nested_measurements_count_once_and_the_fractions_add_up():
  clock = timing.LoopClock()
  with clock.measure("train"):
    time.sleep(0.02)
    with clock.measure("data"):
      time.sleep(0.05)
    with clock.measure("compile"):
      time.sleep(0.03)
  assert clock.seconds["data"] >= 0.05 and clock.seconds["compile"] >= 0.03
  assert 0.02 <= clock.seconds["train"] < 0.05  # Not the nested 0.08 s.
  assert sum(clock.fractions().values()) == pytest.approx(1.0)


def test_eval_and_checkpoint_time_is_accounted_and_a_resume_adds_to_it(tmp_path):
  def fit(steps, workdir):
    trainer = CNNTrainer(cnn_config(log_every_steps=2, eval_every_steps=2))
    writer = writers.create_writer(str(workdir))
    checkpointer = Checkpointer(str(workdir / "checkpoints"), every_steps=2, async_save=False)
    batches = image_batches(steps, 16)
    trainer.fit(lambda start: batches[start:], num_steps=steps, checkpointer=checkpointer,
                writer=writer, eval_batches=lambda: image_batches(1, 16, seed=9))
    checkpointer.close()
    writer.close()
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()
            if '"train"' in line]

  first = fit(2, tmp_path)
  assert first[-1]["time_eval"] > 0 and first[-1]["time_compile"] > 0
  resumed = fit(4, tmp_path)[-1]  # From checkpoint 2: the totals go on.
  assert resumed["step"] == 4 and resumed["time_restart"] > 0
  assert resumed["time_checkpoint"] > 0  # The save at step 2, carried in the checkpoint.


# -- The watchdog ----------------------------------------------------------------------------


def test_the_watchdog_fires_on_no_progress_and_allows_slow_categories(tmp_path):
  exits, cleaned = [], []
  watchdog = timing.Watchdog(0.2, 1.0, cleanup=lambda: cleaned.append(1), exit=exits.append)
  clock = timing.LoopClock()
  clock.watchdog = watchdog
  watchdog.start()
  with clock.measure("compile"):
    time.sleep(0.5)  # Over the limit, within the slow one.
  assert exits == []
  with clock.measure("train"):
    time.sleep(1.2)
  assert exits == [timing.WATCHDOG_EXIT_CODE] and cleaned == [1]


class _SlowFirstRun:
  """A call's output whose first run takes `seconds` to finish (compilation is done, the
  collectives are still being set up), as a jax array's `block_until_ready` would wait."""

  def __init__(self, seconds: float):
    self.seconds = seconds

  def block_until_ready(self):
    time.sleep(self.seconds)
    self.seconds = 0.0
    return self

  def __array__(self, dtype=None, copy=None):  # Reading the flag waits for the call.
    self.block_until_ready()
    return np.ones((), bool)


def test_the_watchdog_gives_a_first_calls_one_time_work_the_slow_limit():
  from trainer.loop import driver

  exits = []
  watchdog = timing.Watchdog(0.3, 3.0, exit=exits.append)
  clock = timing.LoopClock()
  clock.watchdog = watchdog
  first = _SlowFirstRun(1.0)  # Over the step limit, within the slow one.

  def advance(state, step):
    return state, {"finite": first if step == 0 else np.ones(())}, step + 1, None

  advance.compiles_at = lambda step: step == 0
  finite = driver.FiniteCheck(skip=False, to_host=np.asarray, which_models=lambda flags: "",
                              saved_note=lambda: "")
  watchdog.start()
  try:
    result = driver.run(advance, state=0, start=0, num_steps=3, actions=(), finite=finite,
                        clock=clock)
  finally:
    watchdog.stop()
  assert exits == [] and result.step == 3
  assert clock.seconds["compile"] >= 1.0  # The first run is counted as one-time work.


def test_an_unfinished_save_is_removed():
  import tempfile
  directory = pathlib.Path(tempfile.mkdtemp())
  (directory / "4").mkdir()
  (directory / "8.orbax-checkpoint-tmp-1795460000").mkdir()
  Checkpointer(directory).remove_partial()
  assert sorted(p.name for p in directory.iterdir()) == ["4"]


def test_a_hung_run_exits_with_its_stacks_and_the_same_command_resumes_exactly(tmp_path):
  def command(*extra):
    return [sys.executable, str(HERE / "resume_run.py"), f"--workdir={tmp_path / 'work'}",
            "--steps=16", "--every=4", f"--out={tmp_path / 'final.npz'}", *extra]

  start = time.monotonic()
  hung = subprocess.run(command("--hang_at=10", "--watchdog=3"), capture_output=True,
                        text=True, timeout=300)
  assert hung.returncode == timing.WATCHDOG_EXIT_CODE, hung.stderr[-3000:]
  assert time.monotonic() - start < 120
  assert "Watchdog: nothing finished for 3 s in other" in hung.stderr, hung.stderr[-3000:]
  assert "Thread 0x" in hung.stderr and "in hang" in hung.stderr  # faulthandler's stacks.
  steps = sorted(p.name for p in (tmp_path / "work" / "checkpoints").iterdir())
  assert steps == ["4", "8"]  # Complete checkpoints only.
  resumed = subprocess.run(command("--watchdog=3"), capture_output=True, text=True,
                           timeout=300)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "Resuming at step 8" in resumed.stderr
  straight = subprocess.run(
      [sys.executable, str(HERE / "resume_run.py"), f"--workdir={tmp_path / 'straight'}",
       "--steps=16", "--every=4", f"--out={tmp_path / 'straight.npz'}"],
      capture_output=True, text=True, timeout=300)
  assert straight.returncode == 0, straight.stderr[-3000:]
  a, b = np.load(tmp_path / "final.npz"), np.load(tmp_path / "straight.npz")
  for key in a:
    np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def test_watchdog_settings_are_checked_when_the_trainer_is_built():
  with pytest.raises(ValueError, match=r"config.watchdog_seconds=-1.0 must be a number of "
                                       r"seconds >= 0 \(0: no watchdog\)"):
    CNNTrainer(cnn_config(watchdog_seconds=-1))



def test_the_gpu_script_fails_a_run_cut_at_its_budget_and_writes_outside_the_tree(tmp_path):
  """`benchmarks/gpu.py` with a budget too short for its stage: the stage is stopped, the
  exit status says the run is partial (2), and the results file is the temporary
  directory's, not the working directory's."""
  import os
  import pathlib
  import subprocess
  import sys
  root = pathlib.Path(__file__).resolve().parents[1]
  temp, work = tmp_path / "temp", tmp_path / "work"
  temp.mkdir()
  work.mkdir()
  done = subprocess.run([sys.executable, str(root / "benchmarks" / "gpu.py"), "--only",
                         "attention", "--budget", "1"], capture_output=True, text=True,
                        cwd=work, env={**os.environ, "TMPDIR": str(temp)}, timeout=300)
  assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
  assert "stopped at the budget" in (temp / "gpu_results.md").read_text()
  assert not list(work.iterdir())
