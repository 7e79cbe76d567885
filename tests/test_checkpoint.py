"""Checkpoints: exact resume after SIGKILL, SIGTERM and Ctrl-C; cross-strategy restore; bad input.

Tests where a process dies run `tests/resume_run.py` in a real subprocess;
the rest run in-process on the 8 fake devices.
"""

import hashlib
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import MLPTrainer, mlp_config, vector_batches
from jax.sharding import PartitionSpec

from strategies.single_device import SingleDevice
from trainer.checkpoint import Checkpointer, CheckpointError, RunState, save_run, store
from trainer.loop.driver import NonFiniteError

HERE = pathlib.Path(__file__).resolve().parent
SCRIPT = HERE / "resume_run.py"
STEPS, EVERY = 24, 4


# -- Real processes ------------------------------------------------------------

def _command(workdir, out, *extra):
  return [sys.executable, str(SCRIPT), f"--workdir={workdir}", f"--steps={STEPS}",
          f"--every={EVERY}", f"--out={out}", *extra]


def _run(workdir, out, *extra):
  result = subprocess.run(_command(workdir, out, *extra), capture_output=True, text=True,
                          timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  return result


def _complete_steps(workdir):
  ckpt = pathlib.Path(workdir) / "checkpoints"
  return sorted(int(p.name) for p in ckpt.glob("*") if p.name.isdigit()) if ckpt.exists() else []


def _start_and_signal(workdir, out, sig, after_step):
  """Starts a slow run and sends `sig` once checkpoint `after_step` is complete."""
  proc = subprocess.Popen(_command(workdir, out, "--batch_delay=0.15"),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  deadline = time.monotonic() + 240
  while not any(s >= after_step for s in _complete_steps(workdir)):
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    assert time.monotonic() < deadline, "no checkpoint appeared"
    time.sleep(0.05)
  proc.send_signal(sig)
  stdout, stderr = proc.communicate(timeout=240)
  return proc.returncode, stdout, stderr


def _assert_identical(a_path, b_path):
  a, b = np.load(a_path), np.load(b_path)
  assert sorted(a) == sorted(b)
  for key in a:
    np.testing.assert_array_equal(a[key], b[key], err_msg=key)  # Bit for bit.


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  """The uninterrupted run's final state."""
  tmp = tmp_path_factory.mktemp("straight")
  _run(tmp / "work", tmp / "final.npz")
  return tmp / "final.npz"


def test_sigkill_then_same_command_resumes_bit_for_bit(tmp_path, straight):
  rc, _, _ = _start_and_signal(tmp_path / "work", tmp_path / "final.npz", signal.SIGKILL, 8)
  assert rc == -signal.SIGKILL
  assert not (tmp_path / "final.npz").exists()
  killed_at = max(_complete_steps(tmp_path / "work"))
  assert 8 <= killed_at < STEPS
  result = _run(tmp_path / "work", tmp_path / "final.npz")
  assert f"Resuming at step {killed_at}" in result.stderr
  _assert_identical(straight, tmp_path / "final.npz")


def test_sigterm_saves_exits_zero_and_resumes_bit_for_bit(tmp_path, straight):
  rc, _, stderr = _start_and_signal(tmp_path / "work", tmp_path / "final.npz",
                                    signal.SIGTERM, 8)
  assert rc == 0, stderr[-3000:]
  line = next(ln for ln in stderr.splitlines() if "Stopped by SIGTERM at step" in ln)
  stopped = int(line.split("at step ")[1].split()[0])
  assert 8 <= stopped < STEPS
  assert max(_complete_steps(tmp_path / "work")) == stopped  # Saved where it stopped.
  assert f"checkpoints/{stopped}" in line
  result = _run(tmp_path / "work", tmp_path / "final.npz")
  assert f"Resuming at step {stopped}" in result.stderr
  _assert_identical(straight, tmp_path / "final.npz")


def test_ctrl_c_saves_exits_zero_and_resumes_bit_for_bit(tmp_path, straight):
  """The first SIGINT is a stop at the next step with a checkpoint, as SIGTERM is."""
  rc, _, stderr = _start_and_signal(tmp_path / "work", tmp_path / "final.npz",
                                    signal.SIGINT, 8)
  assert rc == 0, stderr[-3000:]
  assert "KeyboardInterrupt" not in stderr and "Traceback" not in stderr
  assert "press Ctrl-C again to stop at once" in stderr
  line = next(ln for ln in stderr.splitlines() if "Stopped by SIGINT at step" in ln)
  stopped = int(line.split("at step ")[1].split()[0])
  assert max(_complete_steps(tmp_path / "work")) == stopped  # Saved where it stopped.
  result = _run(tmp_path / "work", tmp_path / "final.npz")
  assert f"Resuming at step {stopped}" in result.stderr
  _assert_identical(straight, tmp_path / "final.npz")


def test_a_second_ctrl_c_stops_at_once_with_one_line(tmp_path):
  """Two SIGINTs: no save after the second, status 130, one line, no traceback."""
  work = tmp_path / "work"
  proc = subprocess.Popen(_command(work, tmp_path / "final.npz", "--batch_delay=1.0"),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  lines = []
  for line in proc.stderr:  # The first Ctrl-C once the run has stepped, the second once told.
    lines.append(line)
    if line.startswith("INFO:root:step "):
      proc.send_signal(signal.SIGINT)
    if "press Ctrl-C again" in line:
      proc.send_signal(signal.SIGINT)
      break
  stderr = "".join(lines) + proc.communicate(timeout=120)[1]
  assert proc.returncode == 130, stderr[-3000:]
  assert "Traceback" not in stderr and "Stopped by SIGINT" not in stderr
  assert stderr.strip().splitlines()[-1].startswith("Stopped at once by a second Ctrl-C")
  # No checkpoint of the stop: at most the periodic ones (every EVERY steps) already begun.
  assert all(step % EVERY == 0 for step in _complete_steps(work))


def test_killed_during_a_save_resumes_from_the_previous_checkpoint(tmp_path, straight):
  work = tmp_path / "work"
  result = subprocess.run(_command(work, tmp_path / "final.npz", "--kill_during_save_at=12"),
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == -signal.SIGKILL
  assert _complete_steps(work) == [4, 8]
  assert [p.name for p in (work / "checkpoints").glob("12.*")], "no incomplete save left"
  result = _run(work, tmp_path / "final.npz")
  assert "Resuming at step 8" in result.stderr
  _assert_identical(straight, tmp_path / "final.npz")


# -- Cross-strategy restore -----------------------------------------------------

STRATEGIES = {
    "single_device": {},
    "pmap_data_parallel": {},
    # The MLP config's 2x4 ('data', 'model') mesh: hidden -> model shards W1 and W2.
    "sharded_data_parallel": {},
}


def _trainer(strategy, **overrides):
  return MLPTrainer(mlp_config(**{"strategy.name": strategy, **overrides}))


def _canonical(trainer, state):
  return jax.device_get(trainer.strategy.checkpoint_state(state))


@pytest.mark.parametrize("source,destination", [
    ("pmap_data_parallel", "sharded_data_parallel"),
    ("pmap_data_parallel", "single_device"),
    ("sharded_data_parallel", "pmap_data_parallel"),
    ("sharded_data_parallel", "single_device"),
    ("single_device", "pmap_data_parallel"),
    ("single_device", "sharded_data_parallel"),
])
def test_restore_under_another_strategy(tmp_path, source, destination):
  batches = vector_batches(4, 16, 8)
  writer = _trainer(source)
  ckpt = Checkpointer(tmp_path / "ckpt", every_steps=2)
  saved_state = writer.fit(batches[:2], num_steps=2, checkpointer=ckpt).state
  saved = _canonical(writer, saved_state)
  assert ckpt.all_steps() == [2]

  reader = _trainer(destination)
  restored = reader.restore_checkpoint(ckpt, batches[0])
  for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(_canonical(reader, restored)),
                  strict=True):
    np.testing.assert_array_equal(a, b)
  # Placed exactly as the destination places a fresh state.
  fresh = reader.init_state(batches[0])
  for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(fresh), strict=True):
    assert got.shape == want.shape
    assert got.sharding.is_equivalent_to(want.sharding, got.ndim), (got.sharding, want.sharding)
  if destination == "sharded_data_parallel":
    w1 = restored.params["layers"]["W1"].value
    assert w1.sharding.spec == PartitionSpec(None, None, "model")

  # Training continues from there, with one compiled step, and matches a straight run.
  traces = []
  original = reader.train_step
  reader.train_step = lambda s, b: (traces.append(1), original(s, b))[1]
  continued = reader.fit(batches[2:], num_steps=4, state=restored).state
  assert len(traces) == 1
  reference = _trainer("single_device").fit(batches, num_steps=4).state
  for a, b in zip(jax.tree.leaves(_canonical(reader, continued)),
                  jax.tree.leaves(jax.device_get(reference)), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_replicated_arrays_are_written_whole_and_read_back_like_orbaxs_replica_slices(
    tmp_path, monkeypatch):
  """On CPU devices an array that several devices hold whole is written once, by its first
  replica (`trainer/checkpoint/handler.py`), not in orbax's replica-parallel slices (a
  jitted `slice` program per array and replica); a checkpoint that orbax's default handler
  wrote in slices reads back the same."""
  sliced = []
  slice_in_dim = jax.lax.slice_in_dim
  monkeypatch.setattr(jax.lax, "slice_in_dim",
                      lambda x, *a, **k: (sliced.append(x.shape), slice_in_dim(x, *a, **k))[1])
  batches = vector_batches(2, 16, 8)
  trainer = _trainer("sharded_data_parallel")  # 2 data x 4 model: every array has replicas.
  ours = Checkpointer(tmp_path / "ours", every_steps=2)
  state = trainer.fit(batches, num_steps=2, checkpointer=ours).state
  ours.close()
  assert ours.all_steps() == [2] and sliced == []
  monkeypatch.setattr(store, "state_handler", ocp.StandardCheckpointHandler)
  sliced_by_orbax = Checkpointer(tmp_path / "orbax", every_steps=2)
  save_run(sliced_by_orbax, trainer.strategy, RunState(state, 2))
  sliced_by_orbax.close()
  assert sliced, "orbax's default handler wrote no replica slices: nothing was compared"
  want = _canonical(trainer, state)
  for ckpt in (ours, sliced_by_orbax):
    restored = trainer.restore_checkpoint(Checkpointer(ckpt.directory), batches[0])
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(_canonical(trainer, restored)),
                    strict=True):
      np.testing.assert_array_equal(a, b)


def test_ensemble_checkpoint_restores_one_member_and_the_whole_ensemble(tmp_path):
  batches = vector_batches(3, 16, 8)
  ensemble = _trainer("pmap_ensemble")
  ckpt = Checkpointer(tmp_path / "ckpt", every_steps=2)
  state = ensemble.fit(batches[:2], num_steps=2, checkpointer=ckpt).state
  saved = _canonical(ensemble, state)
  assert jax.tree.leaves(saved)[0].shape[0] == 8  # A leading member axis on disk.

  single = _trainer("single_device")
  member3 = single.restore_checkpoint(ckpt, batches[0], member=3)
  for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(jax.device_get(member3)), strict=True):
    np.testing.assert_array_equal(a[3], b)
  with pytest.raises(CheckpointError, match="ensemble of 8 members.*member=i"):
    single.restore_checkpoint(ckpt, batches[0])
  data_parallel = _trainer("pmap_data_parallel")
  member5 = data_parallel.restore_checkpoint(ckpt, batches[0], member=5)
  for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(_canonical(data_parallel, member5)),
                  strict=True):
    np.testing.assert_array_equal(a[5], b)

  again = _trainer("pmap_ensemble")
  whole = again.restore_checkpoint(ckpt, batches[0])
  for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(_canonical(again, whole)),
                  strict=True):
    np.testing.assert_array_equal(a, b)
  # Member 3 continued alone equals member 3 continued inside the ensemble.
  alone = single.fit(batches[2:], num_steps=3, state=member3).state
  together = again.fit(batches[2:], num_steps=3, state=whole).state
  for a, b in zip(jax.tree.leaves(jax.device_get(alone)),
                  jax.tree.leaves(_canonical(again, together)), strict=True):
    np.testing.assert_allclose(a, b[3], rtol=1e-5, atol=1e-6)


# -- Divergence guard ------------------------------------------------------------

def _with_nan_at(batches, index):
  batches = [dict(b) for b in batches]
  batches[index]["inputs"] = np.full_like(batches[index]["inputs"], np.nan)
  return batches


@pytest.mark.parametrize("strategy", ["single_device", "pmap_data_parallel"])
def test_divergence_stops_naming_the_step_and_keeps_the_last_finite_checkpoint(
    tmp_path, strategy):
  batches = _with_nan_at(vector_batches(9, 16, 8), 5)  # Batch 5 makes step 6.
  ckpt = Checkpointer(tmp_path / "ckpt", every_steps=3)  # Step 6 would be saved.
  trainer = _trainer(strategy)
  with pytest.raises(NonFiniteError, match=r"step 6: .*not finite.*latest checkpoint is step 3"):
    trainer.fit(batches, num_steps=9, checkpointer=ckpt)
  assert ckpt.all_steps() == [3]
  restored = trainer.restore_checkpoint(ckpt, batches[0])
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(_canonical(trainer, restored)))


def test_divergence_skip_leaves_the_update_out_and_counts_it():
  batches = _with_nan_at(vector_batches(8, 16, 8), 5)
  before = _trainer("single_device", nonfinite="skip").fit(batches, num_steps=5).state
  trainer = _trainer("single_device", nonfinite="skip")
  result = trainer.fit(batches, num_steps=6)
  after = result.state
  assert result.skipped_steps == 1
  assert int(after.step) == 6  # The step counter (and so the data order) moves on.
  for a, b in zip(jax.tree.leaves((before.params, before.opt_state)),
                  jax.tree.leaves((after.params, after.opt_state)), strict=True):
    np.testing.assert_array_equal(a, b)
  final = _trainer("single_device", nonfinite="skip").fit(batches, num_steps=8).state
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(final.params))


# -- Bad input ----------------------------------------------------------------------

def _snapshot(directory):
  return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
          for p in sorted(pathlib.Path(directory).rglob("*")) if p.is_file()}


def _saved_run(tmp_path, **overrides):
  batches = vector_batches(4, 16, 8)
  ckpt = Checkpointer(tmp_path / "ckpt", every_steps=2)
  _trainer("single_device", **overrides).fit(batches, num_steps=4, checkpointer=ckpt)
  return batches, ckpt


def test_checkpoint_of_another_model_names_the_parameter_and_both_shapes(tmp_path):
  batches, ckpt = _saved_run(tmp_path)
  before = _snapshot(tmp_path / "ckpt")
  wider = _trainer("single_device", **{"model.depth": 32})
  with pytest.raises(CheckpointError, match=(
      r"step 4 .*'params/layers/W1/value' has shape \(2, 8, 16\) in the checkpoint but "
      r"\(2, 8, 32\)")):
    wider.fit(lambda start: batches[start:] + batches, num_steps=8, checkpointer=ckpt)
  assert _snapshot(tmp_path / "ckpt") == before


def test_single_model_checkpoint_does_not_seed_an_ensemble(tmp_path):
  batches, ckpt = _saved_run(tmp_path)
  with pytest.raises(CheckpointError, match=r"holds a single model.* strategy 'pmap_ensemble' "
                                            r"holds 8 model"):
    _trainer("pmap_ensemble").restore_checkpoint(ckpt, batches[0])


def test_corrupt_checkpoint_names_its_step_and_directory_and_deletes_nothing(tmp_path):
  batches, ckpt = _saved_run(tmp_path)
  manifest = tmp_path / "ckpt" / "4" / "state" / "manifest.ocdbt"
  manifest.write_bytes(b"garbage")
  before = _snapshot(tmp_path / "ckpt")
  trainer = _trainer("single_device")
  step_dir = str(tmp_path / "ckpt" / "4")
  ckpt = Checkpointer(tmp_path / "ckpt", on_corrupt="error")  # "fallback": tests/test_faults.py
  with pytest.raises(CheckpointError, match=f"step 4 in {step_dir} is unreadable or corrupt"):
    trainer.fit(lambda start: batches[start:] + batches, num_steps=8, checkpointer=ckpt)
  assert _snapshot(tmp_path / "ckpt") == before
  assert ckpt.all_steps() == [2, 4]


def test_a_save_that_cannot_be_written_raises_naming_the_step(tmp_path):
  batches, ckpt = _saved_run(tmp_path)
  state = _trainer("single_device").restore_checkpoint(ckpt, batches[0])
  os.rename(tmp_path / "ckpt", tmp_path / "moved")
  (tmp_path / "ckpt").write_text("not a directory")  # Whatever writes there now fails.
  with pytest.raises(CheckpointError, match=r"saving checkpoint step 6 to .*ckpt failed: "
                                            r"NotADirectoryError"):
    save_run(ckpt, SingleDevice(), RunState(state, 6))


def test_a_failure_in_the_background_write_is_raised_at_the_next_save(tmp_path, monkeypatch):
  batches, ckpt = _saved_run(tmp_path)
  trainer = _trainer("single_device")
  state = trainer.restore_checkpoint(ckpt, batches[0])
  save_run(ckpt, trainer.strategy, RunState(state, 6))  # Returns while orbax writes.

  def failed_write():  # What orbax raises when its background write of step 6 failed.
    raise OSError("No space left on device")

  monkeypatch.setattr(ckpt._manager, "wait_until_finished", failed_write)
  with pytest.raises(CheckpointError, match=r"writing checkpoint step 6 to .*ckpt failed: "
                                            r"OSError: No space left"):
    save_run(ckpt, trainer.strategy, RunState(state, 8))


@pytest.mark.parametrize("field,value,message", [
    ("every_steps", -1, r"config.checkpoint.every_steps=-1 must be an integer >= 0"),
    ("max_to_keep", 0, r"config.checkpoint.max_to_keep=0 must be an integer >= 1"),
])
def test_bad_checkpoint_settings_fail_before_anything_is_written(tmp_path, field, value,
                                                                 message):
  config = mlp_config(**{f"checkpoint.{field}": value})
  with pytest.raises(ValueError, match=message):
    Checkpointer.from_config(config, str(tmp_path / "work"))
  assert not (tmp_path / "work").exists()


def test_unknown_nonfinite_action_is_rejected():
  with pytest.raises(ValueError, match=r"config.nonfinite='ignore' is not one of \('stop', "
                                       r"'skip'\)"):
    _trainer("single_device", nonfinite="ignore")


def test_pmap_ensemble_checkpoint_restores_under_sharded_ensemble_and_back(tmp_path):
  batches = vector_batches(2, 16, 8)
  pmap = _trainer("pmap_ensemble", ensemble_size=8)
  ckpt = Checkpointer(tmp_path / "ckpt", every_steps=2)
  saved = _canonical(pmap, pmap.fit(batches, num_steps=2, checkpointer=ckpt).state)
  jit = _trainer("sharded_ensemble", ensemble_size=8, **{"strategy.ensemble_mesh_shape": (4, 2)})
  restored = jit.restore_checkpoint(ckpt, batches[0])
  for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(_canonical(jit, restored)),
                  strict=True):
    np.testing.assert_array_equal(a, b)
  assert jax.tree.leaves(restored)[0].sharding.spec == PartitionSpec("ensemble")
  back = Checkpointer(tmp_path / "back", every_steps=2)
  save_run(back, jit.strategy, RunState(restored, 2))
  back.wait()
  again = _trainer("pmap_ensemble", ensemble_size=8).restore_checkpoint(back, batches[0])
  for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(_canonical(pmap, again)), strict=True):
    np.testing.assert_array_equal(a, b)
