"""RL's parts that need no model: rewards named by import path and checked, and the loss
types' aggregation (`trainer.rl`); equality with TRL is `test_rl_trl.py`'s."""

import jax.numpy as jnp
import numpy as np
import pytest

from trainer.rl import losses, rewards


def test_rewards_are_weighted_and_kept_per_function():
  funcs = rewards.load(["rl_rewards:length", "rl_rewards.says_yes"], (0.5, 2.0))
  total, each = rewards.score(funcs, prompts=["q"] * 3, completions=["yes", "no", "yes!"],
                              prompt_ids=[[1]] * 3, completion_ids=[[2], [3], []])
  assert each == {"rl_rewards:length": [3.0, 2.0, 4.0], "rl_rewards.says_yes": [1.0, 0.0, 0.0]}
  assert total == [0.5 * 3 + 2.0, 0.5 * 2, 0.5 * 4]


@pytest.mark.parametrize("specs,weights,match", [
    ((), (), r"config\.rl\.rewards=\(\) names no reward function"),
    (("rl_rewards:missing",), (), r"cannot import the reward function 'rl_rewards:missing'"),
    (("no_such_module:f",), (), r"cannot import the reward function 'no_such_module:f'"),
    (("rl_rewards:NOT_CALLABLE",), (), r"'rl_rewards:NOT_CALLABLE' is a int, not a function"),
    (("rl_rewards:length",), (1.0, 2.0), r"has 2 weights for 1 reward functions"),
    (("rl_rewards:length",), (float("inf"),), r"inf for 'rl_rewards:length' must be a finite"),
])
def test_a_reward_that_cannot_be_loaded_is_refused_naming_it(specs, weights, match):
  with pytest.raises(ValueError, match=match):
    rewards.load(specs, weights)


@pytest.mark.parametrize("name,match", [
    ("not_a_number", r"'rl_rewards:not_a_number' returned nan for completion 0 \('a'\)"),
    ("too_few", r"'rl_rewards:too_few' returned 1 values for 2 completions"),
])
def test_a_reward_that_returns_other_than_a_finite_number_each_is_refused(name, match):
  funcs = rewards.load([f"rl_rewards:{name}"])
  with pytest.raises(ValueError, match=match):
    rewards.score(funcs, prompts=["p", "p"], completions=["a", "b"], prompt_ids=[[1], [1]],
                  completion_ids=[[2], [3]])


def test_each_loss_type_is_the_mean_of_its_per_sequence_losses():
  rng = np.random.default_rng(0)
  per_token = jnp.asarray(rng.normal(size=(6, 5)), jnp.float32)
  mask = jnp.asarray((np.arange(5)[None] < rng.integers(1, 6, (6, 1))), jnp.float32)
  kept = per_token * mask
  expected = {"grpo": float((kept.sum(1) / mask.sum(1)).mean()),
              "dr_grpo": float(kept.sum() / (6 * 7)), "dapo": float(kept.sum() / mask.sum())}
  for loss_type, value in expected.items():
    got = losses.per_sequence(per_token, mask, loss_type, max_completion_length=7).mean()
    np.testing.assert_allclose(float(got), value, rtol=1e-6)


def test_a_group_of_one_and_an_unknown_scale_are_refused():
  with pytest.raises(ValueError, match=r"group_size=1: a group needs at least 2"):
    losses.group_advantages(jnp.zeros(4), 1)
  with pytest.raises(ValueError, match=r"scale='batch' is not one of \('group', 'none'\)"):
    losses.group_advantages(jnp.zeros(4), 2, scale="batch")
