"""The loop as a driver plus actions: users add actions without editing the Trainer,
the order of actions states the rules, and `fit` returns its results as a value."""

import jax
import numpy as np
import pytest
from conftest import MLPTrainer, mlp_config, vector_batches

from trainer import Action, FitResult, NonFiniteError, PeriodicCallback
from trainer.actions import Checkpoint, FiniteGuard
from trainer.checkpoint import Checkpointer


class SeenSteps(Action):
  """Records the steps it ran at and a host value of the state there; keeps a counter."""

  def __init__(self, *, every_steps=1, reads_state=False):
    super().__init__(every_steps=every_steps)
    self.reads_state = reads_state
    self.steps, self.finite, self.calls = [], [], 0

  def run(self, loop):
    self.calls += 1
    self.steps.append(loop.step)
    self.finite.append(bool(np.isfinite(np.asarray(
        jax.tree.leaves(loop.trainer.strategy.to_canonical(loop.state.params))[0])).all()))

  def state_dict(self):
    return {"calls": self.calls}

  def load_state_dict(self, state):
    self.calls = state["calls"]


def test_a_user_action_runs_on_its_schedule_and_fit_returns_a_value():
  seen, ends = SeenSteps(every_steps=2), []
  callback = PeriodicCallback(lambda loop: ends.append(loop.step), every_steps=5, at_end=True)
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


def test_a_checkpoint_placed_before_the_guard_would_save_a_non_finite_state(tmp_path):
  """The order is the rule: the default order never saves step 3 (its NaN state) or later;
  with the guard last, steps 3 and 4 are saved before the guard sees step 3's flag."""
  batches = _nan_at(vector_batches(5, 16, 8), 3)

  class GuardLast(MLPTrainer):
    def default_actions(self, **kwargs):
      actions = super().default_actions(**kwargs)
      guard = next(a for a in actions if isinstance(a, FiniteGuard))
      return [a for a in actions if a is not guard] + [guard]

  for trainer_cls, saved in ((MLPTrainer, [1, 2]), (GuardLast, [1, 2, 3, 4])):
    ckpt = Checkpointer(tmp_path / trainer_cls.__name__, every_steps=1, max_to_keep=5)
    with pytest.raises(NonFiniteError):
      trainer_cls(mlp_config()).fit(batches, num_steps=5, checkpointer=ckpt)
    assert ckpt.all_steps() == saved
    assert any(isinstance(a, Checkpoint) for a in trainer_cls(mlp_config()).default_actions(
        checkpointer=ckpt, eval_batches=None, workdir=None))
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
