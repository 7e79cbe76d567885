"""Several train steps per compiled call, and datasets that live on the devices.

`config.steps_per_call = k` must change how often the host dispatches, never
the result: under every strategy, with a model written the Flax examples' way
(BatchNorm with `axis_name`, dropout with `deterministic`), k steps a call
give the bits of one step a call on CPU (the default loop there unrolls the
steps), per-step metrics included; calls end where an action needs the state.
`config.data.pipeline = "device"` gives the batches the in-memory pipeline
gives with the same permutation.
"""

import json
import os
import signal

import jax
import numerics
import numpy as np
import pytest
from conftest import ALL_STRATEGIES as STRATEGIES
from conftest import CNNTrainer, cnn_config, image_batches, leaves
from user_models import FlaxStyleTrainer

from trainer import data as data_lib
from trainer import writers
from trainer.checkpoint import Checkpointer
from trainer.loop.actions import Action
from trainer.loop.chunks import ChunkPlan
from trainer.loop.driver import NonFiniteError
from trainer.run.start import step_of


class Calls(Action):
  """Records each call's `(previous_step, step)`; needs no boundary of its own."""

  def __init__(self):
    super().__init__(every_steps=1)
    self.calls = []

  def next_boundary(self, step):
    return None

  def run(self, view):
    self.calls.append((view.previous_step, view.step))


def _train_records(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  return {r["step"]: r for r in rows if r["split"] == "train"}


def _fit(tmp_path, name, strategy="single_device", *, k, batches, num_steps,
         trainer_cls=None, **overrides):
  config = cnn_config(**STRATEGIES[strategy], steps_per_call=k, log_every_steps=1,
                      **overrides)
  trainer = (trainer_cls or FlaxStyleTrainer)(config)
  workdir = str(tmp_path / name)
  writer = writers.create_writer(workdir)
  calls = Calls()
  try:
    result = trainer.fit(batches, num_steps=num_steps, writer=writer, actions=[calls])
  finally:
    writer.close()
  return trainer, result, _train_records(workdir), calls.calls


def _state(trainer, state):
  return leaves(trainer.strategy.to_canonical(state))


def _assert_same(a, b, exact):
  if exact:
    np.testing.assert_array_equal(a, b)
  else:
    np.testing.assert_allclose(a, b, rtol=TOLERANCE, atol=TOLERANCE)


#: Where XLA:CPU fuses the unrolled steps of a call differently from one step
#: (FlaxStyleNet's dense/BatchNorm chain): float32 round-off, at most 1e-7
#: absolute measured after 10 steps; the CNN's steps keep their bits.
TOLERANCE = 1e-6


@pytest.mark.parametrize("model", ["cnn", "flax_style"])
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_k_steps_a_call_equal_one_step_a_call(tmp_path, strategy, model):
  trainer_cls, exact = {"cnn": (CNNTrainer, True), "flax_style": (FlaxStyleTrainer, False)}[model]
  batches = image_batches(10, 16)
  t1, one, rows1, _ = _fit(tmp_path, "k1", strategy, k=1, batches=batches, num_steps=10,
                           trainer_cls=trainer_cls)
  t4, four, rows4, calls = _fit(tmp_path, "k4", strategy, k=4, batches=batches, num_steps=10,
                                trainer_cls=trainer_cls)
  assert calls == [(0, 4), (4, 8), (8, 10)]  # 10 is not a multiple of 4: ends at 10.
  assert four.step == 10 and step_of(four.state, t4.strategy) == 10
  if exact:
    for a, b in zip(_state(t1, one.state), _state(t4, four.state), strict=True):
      np.testing.assert_array_equal(a, b)
  else:  # Within the one-step run's own float32 noise (tests/numerics.py).
    chaos = numerics.chaos_fits(t1, batches, num_steps=10,
                                view=lambda state: _state(t1, state))
    numerics.assert_equivalent(_state(t4, four.state), _state(t1, one.state), chaos)
  assert sorted(rows4) == sorted(rows1) == list(range(1, 11))  # A loss for every step.
  for name in ("loss", "accuracy"):
    _assert_same([rows4[s][name] for s in range(1, 11)], [rows1[s][name] for s in range(1, 11)],
                 exact)
  if model == "flax_style":  # BatchNorm's statistics went through the calls too.
    assert not np.allclose(_state(t1, t1.init_state(batches[0]).model_state)[0],
                           _state(t1, one.state.model_state)[0])


def test_a_scan_loop_agrees_within_float_tolerance(tmp_path):
  """`steps_loop='scan'` on CPU compiles the step into a loop body, which XLA fuses
  differently: not bitwise, equal to float32 round-off."""
  batches = image_batches(8, 16)
  t1, one, rows1, _ = _fit(tmp_path, "k1", k=1, batches=batches, num_steps=8)
  t4, four, rows4, _ = _fit(tmp_path, "scan", k=4, batches=batches, num_steps=8,
                            steps_loop="scan")
  for a, b in zip(_state(t1, one.state), _state(t4, four.state), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose([rows4[s]["loss"] for s in range(1, 9)],
                             [rows1[s]["loss"] for s in range(1, 9)], rtol=1e-5)


def _with_nan_at(batches, index):
  batches = [dict(b) for b in batches]
  batches[index]["image"] = np.full_like(batches[index]["image"], np.nan)
  return batches


def test_skip_accumulation_and_ema_equal_one_step_a_call(tmp_path):
  batches = _with_nan_at(image_batches(10, 16), 6)  # Step 7, inside the call 4..8.
  recipe = {"nonfinite": "skip", "grad_accum_steps": 2, "ema_decay": 0.9}
  t1, one, rows1, _ = _fit(tmp_path, "k1", k=1, batches=batches, num_steps=10,
                           trainer_cls=CNNTrainer, **recipe)
  t4, four, rows4, _ = _fit(tmp_path, "k4", k=4, batches=batches, num_steps=10,
                            trainer_cls=CNNTrainer, **recipe)
  assert one.skipped_steps == four.skipped_steps == 1
  # Microbatches and the EMA in the unrolled calls fuse differently: float32 round-off,
  # measured against the one-step run's own noise (tests/numerics.py).
  chaos = numerics.chaos_fits(t1, batches, num_steps=10, view=lambda state: _state(t1, state))
  numerics.assert_equivalent(_state(t4, four.state), _state(t1, one.state), chaos)
  assert [rows4[s]["skipped_steps"] for s in range(1, 11)] == \
      [rows1[s]["skipped_steps"] for s in range(1, 11)] == [0] * 6 + [1] * 4


def test_a_nan_inside_a_call_is_reported_by_its_step_and_never_saved(tmp_path):
  batches = _with_nan_at(image_batches(12, 16), 6)  # Step 7.
  trainer = FlaxStyleTrainer(cnn_config(steps_per_call=4))
  ckpt = Checkpointer(tmp_path / "ckpt", every_steps=5)
  with pytest.raises(NonFiniteError, match=r"step 7: .*not finite.*latest checkpoint is step 5"):
    trainer.fit(batches, num_steps=12, checkpointer=ckpt)
  assert ckpt.all_steps() == [5]


def test_calls_end_at_checkpoint_steps_with_two_lengths(tmp_path):
  batches = image_batches(20, 16)
  trainer = FlaxStyleTrainer(cnn_config(steps_per_call=4))
  ckpt = Checkpointer(tmp_path / "ckpt", every_steps=10, max_to_keep=5)
  calls = Calls()
  trainer.fit(batches, num_steps=20, checkpointer=ckpt, actions=[calls])
  assert ckpt.all_steps() == [10, 20]  # Written at 10, not 12.
  assert [b - a for a, b in calls.calls] == [4, 4, 2, 4, 4, 2]


def test_a_resumed_run_is_exact(tmp_path):
  batches = image_batches(20, 16)
  config = cnn_config(steps_per_call=4)
  ckpt = Checkpointer(tmp_path / "ckpt", every_steps=6)
  CNNTrainer(config).fit(lambda s: batches[s:], num_steps=12, checkpointer=ckpt)
  assert ckpt.all_steps() == [6, 12]
  resumed = CNNTrainer(config)
  result = resumed.fit(lambda s: batches[s:], num_steps=20,
                       checkpointer=Checkpointer(tmp_path / "ckpt", every_steps=6))
  reference = CNNTrainer(cnn_config(steps_per_call=1))
  whole = reference.fit(batches, num_steps=20)
  for a, b in zip(_state(reference, whole.state), _state(resumed, result.state), strict=True):
    np.testing.assert_array_equal(a, b)


class SignalAt(Action):
  """Sends this process SIGTERM once the run has passed `step` (as a preemption would)."""

  def __init__(self, step):
    super().__init__(every_steps=1)
    self.step, self.sent = step, False

  def next_boundary(self, step):
    return None

  def run(self, view):
    if view.step >= self.step and not self.sent:
      self.sent = True
      os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_stops_within_one_call_and_saves(tmp_path):
  batches = image_batches(40, 16)
  trainer = FlaxStyleTrainer(cnn_config(steps_per_call=4))
  ckpt = Checkpointer(tmp_path / "ckpt", every_steps=100)
  calls = Calls()
  result = trainer.fit(batches, num_steps=40, checkpointer=ckpt,
                       actions=[SignalAt(5), calls])
  # Sent after the call that ended at 8; the next call (to 12) is the last.
  assert result.stopped_by == "SIGTERM" and result.step == 12
  assert calls.calls[-1] == (8, 12)
  assert ckpt.all_steps() == [12]


# -- Data that lives on the devices ---------------------------------------------------------

def _split(num=72, seed=0):
  rng = np.random.default_rng(seed)
  return data_lib.Split(images=rng.integers(0, 256, (num, 28, 28, 1), dtype=np.uint8),
                        labels=rng.integers(0, 10, num).astype(np.int32))


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_device_data_gives_the_memory_pipelines_batches(strategy):
  """72 examples, batch 16: 4 steps an epoch, so 10 steps cross two epoch boundaries."""
  split = _split()
  device = split.device_data(16, seed=3)
  config = cnn_config(**STRATEGIES[strategy], steps_per_call=4)
  on_device = CNNTrainer(config)
  got = on_device.fit(device, num_steps=10)
  in_memory = CNNTrainer(cnn_config(**STRATEGIES[strategy]))
  want = in_memory.fit(lambda s: data_lib.train_batches(split, 16, 3, s,
                                                        permutation=device.permutation),
                       num_steps=10)
  assert got.step == 10
  for a, b in zip(_state(in_memory, want.state), _state(on_device, got.state), strict=True):
    if strategy == "sharded_ensemble":  # XLA fuses the in-step gather into the step there.
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    else:
      np.testing.assert_array_equal(a, b)


def test_device_data_orders_are_permutations_of_seed_and_epoch():
  device = _split().device_data(16, seed=3)
  orders = device.orders(0, 3)
  assert orders.shape == (3, 72)
  for epoch, order in enumerate(orders):
    assert sorted(order.tolist()) == list(range(72))
    np.testing.assert_array_equal(order, device.permutation(epoch))
  assert not np.array_equal(orders[0], orders[1])
  again = _split().device_data(16, seed=3)
  np.testing.assert_array_equal(again.orders(1, 1)[0], orders[1])
  assert not np.array_equal(_split().device_data(16, seed=4).orders(0, 1)[0], orders[0])


def test_device_data_resumes_at_its_step(tmp_path):
  split = _split()
  device = split.device_data(16, seed=3)
  config = cnn_config(steps_per_call=4)
  CNNTrainer(config).fit(device, num_steps=6,
                         checkpointer=Checkpointer(tmp_path / "c", every_steps=6))
  resumed = CNNTrainer(config)
  result = resumed.fit(device, num_steps=12,
                       checkpointer=Checkpointer(tmp_path / "c", every_steps=6))
  whole = CNNTrainer(config)  # Its calls end where the resumed run's do: the same programs.
  want = whole.fit(device, num_steps=12,
                   checkpointer=Checkpointer(tmp_path / "whole", every_steps=6))
  assert result.step == 12
  for a, b in zip(_state(whole, want.state), _state(resumed, result.state), strict=True):
    np.testing.assert_array_equal(a, b)


# -- The plan of call lengths ------------------------------------------------------------------

class Every(Action):
  def __init__(self, every):
    super().__init__(every_steps=every)


@pytest.mark.parametrize("k,start,num_steps,periods,lengths", [
    (4, 0, 20, [10], [4, 4, 2, 4, 4, 2]),  # Periodic: the remainder is the second length.
    (4, 0, 10, [], [4, 4, 2]),
    (4, 0, 12, [], [4, 4, 4]),
    (4, 0, 30, [6, 10], [4, 2, 4, 2, 4, 2, 2, 4, 4, 2]),  # Gaps 6,4,2,6,2,4,6: one remainder.
    (8, 0, 30, [6, 10], [2] * 15),  # Remainders 6, 4, 2: their gcd with 8.
    (4, 3, 11, [], [4, 4]),
    (64, 0, 100, [1], [1] * 100),
])
def test_a_plan_ends_calls_at_boundaries_with_at_most_two_lengths(k, start, num_steps,
                                                                   periods, lengths):
  plan = ChunkPlan(k, start=start, num_steps=num_steps, actions=[Every(p) for p in periods])
  got, step = [], start
  while step < num_steps:
    got.append(plan.size(step))
    step += got[-1]
  assert got == lengths
  assert len(set(got)) <= 2 and set(got) <= set(plan.sizes)
  ends = np.cumsum([start] + got)
  for p in periods:
    assert set(range(p, num_steps + 1, p)) <= set(ends.tolist())


@pytest.mark.parametrize("field,value,message", [
    ("steps_per_call", 0, r"config.steps_per_call=0 must be an integer >= 1"),
    ("steps_per_call", -3, r"config.steps_per_call=-3 must be an integer >= 1"),
    ("steps_loop", "while", r"config.steps_loop='while' is not one of \('scan', 'unroll'\)"),
])
def test_bad_steps_settings_are_refused_before_any_compute(field, value, message):
  with pytest.raises(ValueError, match=message):
    FlaxStyleTrainer(cnn_config(**{field: value}))


def test_device_data_refuses_a_batch_larger_than_the_split():
  with pytest.raises(ValueError, match=r"config.batch_size=128 exceeds the 72 training"):
    _split().device_data(128, seed=0)


def test_outputs_hold_each_step_of_a_call():
  trainer = FlaxStyleTrainer(cnn_config(**STRATEGIES["pmap_data_parallel"], steps_per_call=4))
  batches = image_batches(4, 16)
  state = trainer.init_state(batches[0])
  call = trainer.compiled.train_chunk(state)
  stacked = trainer.strategy.put_batches(jax.tree.map(lambda *x: np.stack(x), *batches))
  _, outputs = call(state, stacked, None)
  flags = np.asarray(outputs["finite"])
  assert flags.shape[trainer.strategy.steps_axis] == 4
