"""Sweeps as ensembles: one compiled run trains a grid of optimizer hyperparameters.

Member i of a sweep must be the single-device run with member i's
hyperparameters and seed (`Sweep.member_config`), whichever ensemble layout
holds it; its results are reported under its label, and the best member is
exported as a single-model checkpoint that resumes under another strategy.
"""

import json

import jax
import numpy as np
import pytest
from conftest import cnn_config, image_batches
from user_models import FlaxStyleTrainer

from strategies.pmap_data_parallel import PmapDataParallel
from strategies.sharded_ensemble import ShardedEnsemble
from strategies.single_device import SingleDevice
from trainer import writers
from trainer.checkpoint import Checkpointer, CheckpointError
from trainer.run.start import step_of
from trainer.sweep import Sweep


def _config(**overrides):
  return cnn_config(**{"ensemble_size": 0, "schedule.warmup_steps": 2, **overrides})


LAYOUTS = {
    # 8 members, one per device; the EMA's decay swept too.
    "pmap_ensemble": {"strategy.name": "pmap_ensemble", "sweep.grid.learning_rate": (0.1, 0.02),
                      "sweep.grid.momentum": (0.0, 0.9), "sweep.grid.ema_decay": (0.5, 0.9)},
    # 8 members, 4 on each of 2 devices: clipping, weight decay and warmup per member.
    "sharded_4_per_device": {
        "strategy.name": "sharded_ensemble", "strategy.ensemble_mesh_shape": (2, 1),
        "sweep.points": ({"learning_rate": 0.1, "grad_clip_norm": 0.5},
                         {"learning_rate": 0.05, "weight_decay": 0.01},
                         {"learning_rate": 0.02, "warmup_steps": 0},
                         {"learning_rate": 0.1, "grad_clip_norm": 0.0, "weight_decay": 0.001}),
        "sweep.seeds": (5, 6)},
    # 4 members, each split over 2 data devices (BatchNorm over both; each data replica
    # draws its own dropout masks, so the reference is 2-way data parallel, not one device).
    "sharded_data_parallel_members": {
        "strategy.name": "sharded_ensemble", "strategy.ensemble_mesh_shape": (2, 2),
        "sweep.grid.learning_rate": (0.1, 0.03), "sweep.seeds": (0, 7)},
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_each_member_is_the_single_device_run_of_its_hyperparameters(layout):
  config = _config(**LAYOUTS[layout])
  trainer = FlaxStyleTrainer(config)
  batches = image_batches(5, 16)
  swept = trainer.strategy.to_canonical(trainer.fit(batches, num_steps=5).state)
  assert np.shape(jax.tree.leaves(swept.params)[0])[0] == len(trainer.sweep)
  reference = (PmapDataParallel(devices=jax.devices()[:2])
               if layout == "sharded_data_parallel_members" else SingleDevice())
  for i in range(len(trainer.sweep)):
    member = trainer.sweep.member_config(config, i)
    single = FlaxStyleTrainer(member, strategy=reference)
    assert single.sweep is None
    want = single.strategy.to_canonical(single.fit(batches, num_steps=5).state)
    got = (swept.params, swept.model_state, getattr(swept, "ema_params", None))
    for a, b in zip(jax.tree.leaves((want.params, want.model_state,
                                     getattr(want, "ema_params", None))),
                    jax.tree.leaves(got), strict=True):
      np.testing.assert_allclose(np.asarray(b)[i], a, rtol=1e-5, atol=1e-6,
                                 err_msg=trainer.sweep.label(i))
  # The members really differ: the sweep is not one model eight times.
  first = np.asarray(jax.tree.leaves(swept.params)[0])
  assert not np.allclose(first[0], first[-1])


class _Counted:
  """A compiled step that counts its calls (and lowers as the step does)."""

  def __init__(self, fn):
    self.fn, self.calls = fn, 0

  def __call__(self, *args):
    self.calls += 1
    return self.fn(*args)

  def __getattr__(self, name):
    return getattr(self.fn, name)


def test_results_by_label_the_best_member_and_its_export(tmp_path, monkeypatch):
  overrides = {**LAYOUTS["sharded_4_per_device"], "sweep.metric": "accuracy",
               "sweep.mode": "max", "eval_every_steps": 2}
  config = _config(**overrides)
  trainer = FlaxStyleTrainer(config)
  batches = image_batches(8, 16)
  compiled_eval, counted = trainer.compiled.eval, {}
  monkeypatch.setattr(trainer.compiled, "eval", lambda state: counted.setdefault(
      "step", _Counted(compiled_eval(state))))
  workdir = tmp_path / "sweep"
  writer = writers.create_writer(str(workdir))
  checkpointer = Checkpointer(workdir / "checkpoints", every_steps=0)
  result = trainer.fit(lambda s: batches[s:], num_steps=4, writer=writer, workdir=str(workdir),
                       eval_batches=lambda: image_batches(2, 16, seed=9),
                       checkpointer=checkpointer)
  writer.close()
  checkpointer.close()
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  labels = [trainer.sweep.label(i) for i in range(len(trainer.sweep))]
  assert labels[0] == "learning_rate=0.1,weight_decay=0,grad_clip_norm=0.5,warmup_steps=2,seed=5"
  for step in (2, 4):  # Every member's metrics, under its label, at every evaluation.
    got = {r["split"] for r in rows if r["step"] == step}
    assert {f"eval/{label}" for label in labels} <= got
  assert (workdir / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  summary = json.loads((workdir / "sweep.json").read_text())
  accuracies = [m["accuracy"] for m in summary["members"]]
  assert summary["best"]["member"] == int(np.argmax(accuracies))
  assert summary["best"]["label"] == labels[summary["best"]["member"]]
  assert result.best == (4, max(accuracies))
  # Each evaluation ran the eval step once per chunk: the report's member metrics and
  # `Evaluate`'s ensemble metrics (equal to evaluating the final state again) share a pass.
  chunks = sum(len(list(trainer.evaluator.chunks(b))) for b in image_batches(2, 16, seed=9))
  assert counted["step"].calls == 2 * chunks
  # Each member's own train loss under its label (`MemberTrainMetrics`): their mean is the
  # ensemble's `train/loss`.
  for step in sorted({r["step"] for r in rows if r["split"] == "train"}):
    losses = {r["split"]: r["loss"] for r in rows if r["step"] == step and "loss" in r}
    assert {f"train/{label}" for label in labels} <= set(losses), sorted(losses)
    np.testing.assert_allclose(np.mean([losses[f"train/{label}"] for label in labels]),
                               losses["train"], rtol=1e-5)
  (final,) = [r for r in rows if r["split"] == "eval" and r["step"] == 4]
  again = trainer.evaluate(result.state, image_batches(2, 16, seed=9))
  assert counted["step"].calls == 3 * chunks  # A plain iterable is evaluated anew.
  assert again.keys() <= final.keys()
  for name, value in again.items():
    np.testing.assert_allclose(final[name], value, rtol=1e-6, err_msg=name)

  # The best member as a single model: it restores under other strategies and resumes.
  best = summary["best"]["member"]
  member_config = trainer.sweep.member_config(config, best)
  exported = json.loads((workdir / "sweep_best_config.json").read_text())
  assert exported["learning_rate"] == member_config.learning_rate
  swept = trainer.strategy.to_canonical(result.state)
  for name in ("single_device", "pmap_data_parallel"):
    member_config.strategy.name = name
    single = FlaxStyleTrainer(member_config)
    restored = single.restore_checkpoint(Checkpointer(workdir / "sweep_best"), batches[0])
    assert step_of(restored, single.strategy) == 4
    for a, b in zip(jax.tree.leaves(swept.params),
                    jax.tree.leaves(single.strategy.to_canonical(restored.params)), strict=True):
      np.testing.assert_array_equal(np.asarray(a)[best], b)
    # The sweep reported the best member's own metrics (its ECE too, not a share of it).
    alone = single.evaluate(restored, image_batches(2, 16, seed=9))
    for name in ("accuracy", "nll", "ece"):
      np.testing.assert_allclose(summary["best"][name], alone[name], rtol=1e-5, atol=1e-7)
  resumed = single.fit(lambda s: batches[s:], num_steps=6,
                       checkpointer=Checkpointer(workdir / "sweep_best", every_steps=0))
  assert resumed.step == 6

  # Any member from the sweep's own checkpoint, as the guide says: its parameters, model
  # state and optimizer state (converted from the sweep's injected layout), as exported.
  sweep_checkpoints = Checkpointer(workdir / "checkpoints")
  member_config.strategy.name = "single_device"
  single = FlaxStyleTrainer(member_config)
  member = single.restore_checkpoint(sweep_checkpoints, batches[0], member=best)
  export = single.restore_checkpoint(Checkpointer(workdir / "sweep_best"), batches[0],
                                     step=4)  # The export (the run above went on to 6).
  for a, b in zip(jax.tree.leaves((export.params, export.model_state, export.opt_state)),
                  jax.tree.leaves((member.params, member.model_state, member.opt_state)),
                  strict=True):
    np.testing.assert_array_equal(a, b)
  other = (best + 1) % len(trainer.sweep)
  member = single.restore_checkpoint(sweep_checkpoints, batches[0], member=other)
  for a, b in zip(jax.tree.leaves(swept.params), jax.tree.leaves(member.params), strict=True):
    np.testing.assert_array_equal(np.asarray(a)[other], b)
  # Where a member cannot apply, asking for one is an error, never ignored.
  with pytest.raises(CheckpointError, match=r"member=1 .* holds 8 models and strategy "
                                            r"'sharded_ensemble' holds 8 models"):
    trainer.restore_checkpoint(sweep_checkpoints, batches[0], member=1)
  with pytest.raises(CheckpointError, match=r"member=0 .* holds a single model"):
    single.restore_checkpoint(Checkpointer(workdir / "sweep_best"), batches[0], member=0)


def test_a_strategy_built_in_code_starts_the_members_from_the_sweeps_seeds():
  config = _config(**{"strategy.name": "sharded_ensemble", "sweep.grid.learning_rate": (0.1,),
                      "sweep.seeds": (3, 4), "strategy.ensemble_mesh_shape": (2, 1)})
  from_config = FlaxStyleTrainer(config)
  in_code = FlaxStyleTrainer(config, strategy=ShardedEnsemble(num_members=2,
                                                              mesh_shape=(2, 1)))
  batch = image_batches(1, 16)[0]
  for a, b in zip(jax.tree.leaves(from_config.strategy.to_canonical(
                      from_config.init_state(batch).params)),
                  jax.tree.leaves(in_code.strategy.to_canonical(in_code.init_state(batch).params)),
                  strict=True):
    np.testing.assert_array_equal(a, b)


def test_a_grid_is_the_product_of_its_values_times_the_seeds():
  config = _config(**{"strategy.name": "sharded_ensemble", "sweep.grid.learning_rate": (0.1, 0.2),
                      "sweep.grid.weight_decay": (0.0, 0.1, 0.2), "sweep.seeds": (3, 4)})
  sweep = Sweep.from_config(config)
  assert len(sweep) == 12
  assert sweep.varied == ("learning_rate", "weight_decay", "seed")
  assert sweep.label(5) == "learning_rate=0.1,weight_decay=0.2,seed=4"
  assert sweep.members[5]["momentum"] == config.momentum  # Unswept: the config's value.
  assert Sweep.from_config(_config()) is None


@pytest.mark.parametrize("overrides,message", [
    ({"strategy.name": "single_device", "sweep.grid.learning_rate": (0.1, 0.2)},
     r"config.sweep describes 2 members, but strategy 'single_device' trains one model"),
    ({"strategy.name": "sharded_ensemble", "ensemble_size": 8,
      "sweep.grid.learning_rate": (0.1, 0.2)},
     r"config.sweep describes 2 members but the strategy 'sharded_ensemble' holds 8"),
    ({"strategy.name": "sharded_ensemble", "sweep.grid.learning_rate": (0.1, 0.2, 0.3)},
     r"config.sweep describes 3 members .*: config.ensemble_size=3 does not divide over the "
     r"8 devices"),
    ({"strategy.name": "sharded_ensemble", "sweep.points": ({"dropout": 0.1},)},
     r"config.sweep.points has \['dropout'\], which cannot be swept"),
    ({"strategy.name": "sharded_ensemble", "sweep.grid.learning_rate": (0.1, -0.2)},
     r"config.sweep value learning_rate=-0.2 is out of range"),
    ({"strategy.name": "sharded_ensemble", "sweep.grid.ema_decay": (0.0, 0.9)},
     r"config.sweep sweeps ema_decay with a value of 0"),
])
def test_a_sweep_that_cannot_run_is_refused_naming_the_numbers(overrides, message):
  with pytest.raises(ValueError, match=message):
    FlaxStyleTrainer(_config(**overrides))


def test_best_members_that_tie_are_named_as_tied(tmp_path):
  """Clipping at norms no gradient reaches: the members train alike and tie on accuracy,
  and the summary says the first is kept over the other rather than calling it a choice."""
  config = _config(**{"strategy.name": "sharded_ensemble", "strategy.ensemble_mesh_shape":
                      (2, 1), "sweep.grid.grad_clip_norm": (1e6, 1e7),
                      "sweep.metric": "accuracy", "sweep.mode": "max", "eval_every_steps": 2})
  trainer = FlaxStyleTrainer(config)
  workdir = tmp_path / "sweep"
  trainer.fit(image_batches(2, 16), num_steps=2, workdir=str(workdir),
              eval_batches=lambda: image_batches(1, 16, seed=9))
  best = json.loads((workdir / "sweep.json").read_text())["best"]
  assert best["label"] == trainer.sweep.label(0)
  assert best["tied_with"] == [trainer.sweep.label(1)]
