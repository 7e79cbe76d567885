"""The loop as a driver plus actions: users add actions without editing the Trainer,
the order of actions states the rules, and `fit` returns its results as a value."""

import jax
import numpy as np
import pytest
from conftest import MLPTrainer, mlp_config, vector_batches

from trainer import Action, FitResult, NonFiniteError, PeriodicCallback
from trainer.checkpoint import Checkpointer
from trainer.loop import driver
from trainer.loop.actions import Produced
from trainer.loop.builtin import Checkpoint


class SeenSteps(Action):
  """Records the steps it ran at and a host value of the state there; keeps a counter."""

  def __init__(self, *, every_steps=1, reads_state=False):
    super().__init__(every_steps=every_steps)
    self.reads_state = reads_state
    self.steps, self.finite, self.calls = [], [], 0

  def run(self, view):
    self.calls += 1
    self.steps.append(view.step)
    self.finite.append(bool(np.isfinite(np.asarray(
        jax.tree.leaves(view.canonical(view.state.params))[0])).all()))

  def state_dict(self):
    return {"calls": self.calls}

  def load_state_dict(self, state):
    self.calls = state["calls"]


def test_a_user_action_runs_on_its_schedule_and_fit_returns_a_value():
  seen, ends = SeenSteps(every_steps=2), []
  callback = PeriodicCallback(lambda view: ends.append(view.step), every_steps=5, at_end=True)
  batches = vector_batches(7, 16, 8)
  result = MLPTrainer(mlp_config(eval_every_steps=3)).fit(
      batches, num_steps=7, actions=[seen, callback], eval_batches=lambda: batches[:1])
  assert isinstance(result, FitResult)
  assert seen.steps == [2, 4, 6] and ends == [5, 7]
  assert [step for step, _ in result.eval_history] == [3, 6, 7]
  assert (result.step, result.stopped_by, result.skipped_steps) == (7, None, 0)
  assert int(result.state.step) == 7


def _nan_at(batches, step):
  """Batches whose update number `step` (1-based) produces a NaN loss."""
  out = [dict(b) for b in batches]
  out[step - 1]["inputs"] = np.full_like(out[step - 1]["inputs"], np.nan)
  return out


@pytest.mark.parametrize("reads_state", [True, False])
def test_the_guard_checks_a_step_before_any_later_action_that_reads_the_state(reads_state):
  """pmap keeps one step in flight: only an action that declares `reads_state` is guarded."""
  seen = SeenSteps(reads_state=reads_state)
  trainer = MLPTrainer(mlp_config(**{"strategy.name": "pmap_data_parallel"}))
  with pytest.raises(NonFiniteError, match="step 3"):
    trainer.fit(_nan_at(vector_batches(5, 16, 8), 3), num_steps=5, actions=[seen])
  if reads_state:
    assert seen.steps == [1, 2] and all(seen.finite)
  else:  # Unguarded, it saw the non-finite state of step 3 before the guard caught it.
    assert seen.steps == [1, 2, 3] and seen.finite == [True, True, False]


def test_no_order_of_actions_saves_a_non_finite_state(tmp_path):
  """Never saving an unchecked state is the loop's rule, not the order's: with the checkpoint
  first among the actions, as with the default order, steps 3 (its NaN state) and later are
  never saved."""
  batches = _nan_at(vector_batches(5, 16, 8), 3)

  class CheckpointFirst(MLPTrainer):
    def default_actions(self, **kwargs):
      actions = super().default_actions(**kwargs)
      save = next(a for a in actions if isinstance(a, Checkpoint))
      return [save] + [a for a in actions if a is not save]

  for trainer_cls in (MLPTrainer, CheckpointFirst):
    ckpt = Checkpointer(tmp_path / trainer_cls.__name__, every_steps=1, max_to_keep=5)
    with pytest.raises(NonFiniteError):
      trainer_cls(mlp_config()).fit(batches, num_steps=5, checkpointer=ckpt)
    assert ckpt.all_steps() == [1, 2]
    assert isinstance(trainer_cls(mlp_config()).default_actions(
        checkpointer=ckpt, eval_batches=None, workdir=None)[0 if trainer_cls is
                                                             CheckpointFirst else -1],
                      Checkpoint)
    ckpt.close()


def test_an_actions_state_is_saved_with_the_checkpoint_and_restored_on_resume(tmp_path):
  batches = vector_batches(6, 16, 8)
  ckpt = Checkpointer(tmp_path / "ckpt", every_steps=2)
  first = SeenSteps()
  MLPTrainer(mlp_config()).fit(lambda s: batches[s:], num_steps=4, checkpointer=ckpt,
                               actions=[first])
  resumed = SeenSteps()
  result = MLPTrainer(mlp_config()).fit(lambda s: batches[s:], num_steps=6, checkpointer=ckpt,
                                        actions=[resumed])
  assert (first.calls, resumed.steps, resumed.calls, result.step) == (4, [5, 6], 6, 6)
  ckpt.close()


def test_two_actions_with_state_and_one_name_are_refused_before_training():
  with pytest.raises(ValueError, match=r"actions \['SeenSteps'\] appear twice"):
    MLPTrainer(mlp_config()).fit(vector_batches(1, 16, 8), num_steps=1,
                                 actions=[SeenSteps(), SeenSteps()])


# -- The loop's driver on its own: several steps per call --------------------------------------


class Crossings(Action):
  """Records, at each run, the step and the boundaries the call crossed."""

  def __init__(self, every_steps):
    super().__init__(every_steps=every_steps)
    self.runs = []

  def run(self, view):
    self.runs.append((view.step, view.crossed(self.every_steps)))


def test_a_loop_that_advances_three_steps_a_call_misses_no_boundary():
  actions = {every: Crossings(every) for every in (2, 5, 7)}

  def advance(state, step):  # A call that runs 3 steps, as several steps per call will.
    return state + 3, {"finite": np.array(True)}, step + 3, None

  result = driver.run(advance, state=0, start=0, num_steps=21, actions=list(actions.values()))
  assert (result.step, result.state) == (21, 21)
  assert actions[2].runs == [(3, [2]), (6, [4, 6]), (9, [8]), (12, [10, 12]), (15, [14]),
                             (18, [16, 18]), (21, [20])]
  assert actions[5].runs == [(6, [5]), (12, [10]), (15, [15]), (21, [20])]
  assert actions[7].runs == [(9, [7]), (15, [14]), (21, [21])]
  for every, action in actions.items():  # Each boundary reported once, none missed.
    assert [b for _, crossed in action.runs for b in crossed] == list(range(every, 22, every))


def test_what_an_action_produces_reaches_later_actions_and_the_result_not_earlier_ones():
  class Evaluates(Action):
    def run(self, view):
      return Produced(eval_results={"loss": float(view.step)}) if view.step % 2 == 0 else None

  class Reads(Action):
    def __init__(self):
      super().__init__(every_steps=1)
      self.seen = []

    def run(self, view):
      self.seen.append(view.eval_results)
      return Produced(stop="enough") if view.step == 4 else None

  before, after = Reads(), Reads()
  result = driver.run(lambda state, step: (state, {"finite": True}, step + 1, None), state=None,
                      start=0, num_steps=10, actions=[before, Evaluates(), after])
  assert before.seen == [None] * 4
  assert after.seen == [None, {"loss": 2.0}, None, {"loss": 4.0}]
  assert result.eval_history == [(2, {"loss": 2.0}), (4, {"loss": 4.0})]
  assert (result.step, result.stopped_by) == (4, "enough")
