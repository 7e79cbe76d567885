"""RL's parts that need no model: rewards named by import path and checked, and the loss
types' aggregation (`trainer.rl`); equality with TRL is `test_rl_trl.py`'s."""

import jax.numpy as jnp
import numpy as np
import pytest
import rl_setup
from recorder import Recorder
from rl_setup import ROOT, rl_config

from trainer import metrics as metrics_lib
from trainer.rl import losses, rewards


def _call(completions, completion_ids=None, **fields):
  """A reward call's arguments on text prompts `q` with `fields` (one value each)."""
  records = [{"prompt": "q", **{k: v[i] for k, v in fields.items()}}
             for i in range(len(completions))]
  return rewards.arguments(records, completions, prompt_field="prompt",
                           prompt_ids=[[1]] * len(completions),
                           completion_ids=completion_ids or [[2]] * len(completions))


def test_rewards_are_weighted_and_kept_per_function():
  funcs = rewards.load(["rl_rewards:length", "rl_rewards.says_yes"], (0.5, 2.0))
  total, each = rewards.score(funcs, _call(["yes", "no", "yes!"], [[2], [3], []]))
  assert each == {"length": [3.0, 2.0, 4.0], "says_yes": [1.0, 0.0, 0.0]}
  assert total == [0.5 * 3 + 2.0, 0.5 * 2, 0.5 * 4]


def test_two_rewards_of_one_name_are_told_apart_by_their_file(tmp_path):
  for stem in ("a", "b"):
    (tmp_path / f"{stem}.py").write_text("def score(completions, **_):\n"
                                         "  return [1.0] * len(completions)\n")
  funcs = rewards.load([f"{tmp_path / 'a.py'}:score", f"{tmp_path / 'b.py'}:score",
                        "rl_rewards:length"])
  assert [f.name for f in funcs] == ["a_score", "b_score", "length"]
  _, each = rewards.score(funcs, _call(["x", "yy"]))
  assert set(each) == {"a_score", "b_score", "length"}


@pytest.mark.parametrize("specs,weights,match", [
    ((), (), r"config\.rl\.rewards=\(\) names no reward function"),
    (("rl_rewards:missing",), (), r"'rl_rewards:missing': the module rl_rewards has no "
                                  r"'missing'; name one of its functions \(a_string, a_word"),
    (("no_such_module:f",), (), r"cannot import the reward function 'no_such_module:f'"),
    (("rl_rewards:NOT_CALLABLE",), (), r"'rl_rewards:NOT_CALLABLE' is a int, not a function"),
    (("rl_rewards:length",), (1.0, 2.0), r"has 2 weights for 1 reward functions"),
    (("rl_rewards:length",), (float("inf"),), r"inf for 'rl_rewards:length' must be a finite"),
])
def test_a_reward_that_cannot_be_loaded_is_refused_naming_it(specs, weights, match):
  with pytest.raises(ValueError, match=match):
    rewards.load(specs, weights)


@pytest.mark.parametrize("name,match", [
    ("not_a_number", r"'not_a_number' \(rl_rewards:not_a_number\) returned nan for "
                     r"completion 0 \('a'\); it must return one number \(or None: not "
                     r"applicable\) per completion, 2 in all, each finite"),
    ("too_few", r"'too_few' \(rl_rewards:too_few\) returned 1 values for 2 completions"),
    ("a_string", r"'a_string' \(rl_rewards:a_string\) returned 'ab'; it must return a list "
                 r"of one number"),
    ("a_word", r"'a_word' \(rl_rewards:a_word\) returned 'no' for completion 1 \('b'\)"),
])
def test_a_reward_that_returns_other_than_a_finite_number_each_is_refused(name, match):
  funcs = rewards.load([f"rl_rewards:{name}"])
  with pytest.raises(rewards.RewardError, match=match):
    rewards.score(funcs, _call(["a", "b"]))


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


# -- The trainer: a step's rollouts and updates -----------------------------------------

@pytest.fixture(scope="module")
def task(tmp_path_factory):
  return rl_setup.write_task(tmp_path_factory.mktemp("rl_task"))


@pytest.mark.parametrize("layout", ["single_device", "fsdp", "data_tensor"])
def test_the_rollout_and_the_first_update_share_their_log_probs(task, layout):
  """On-policy by construction: the old log-probs and the first update's are one function of
  one state, so their largest difference is float noise (here exactly 0: one program)."""
  from trainer.rl import RLTrainer
  from trainer.rl import data as rl_data
  config = rl_config(task, layout, **{"rl.beta": 0.05})
  trainer = RLTrainer(config)
  stream = rl_data.from_config(config)
  state = trainer.init_state(next(stream()))
  new, outputs = trainer.compiled.train(state)(state, trainer.strategy.put_batch(
      next(stream())))
  import jax
  metrics = metrics_lib.scalars(jax.device_get(outputs["metrics"]))
  assert metrics["on_policy_gap"] <= 1e-6
  assert metrics["completions/mean_length"] == 1.0
  assert 0.0 <= metrics["reward"] <= 1.0
  assert abs(metrics["kl"]) <= 1e-6  # The policy is its reference at the first step.
  assert int(new.step) == 1


def expected_reward(trainer, state, task) -> float:
  """The policy's probability of the right digit, averaged over the 55 prompts: the mean
  reward a sampled completion gets, without sampling's noise."""
  import jax
  import rl_tasks
  from tokenizers import Tokenizer
  tokenizer = Tokenizer.from_file(task[1])
  prompts = rl_tasks.addition_prompts()
  ids = np.asarray([[0] + tokenizer.encode(p, add_special_tokens=False).ids for p in prompts],
                   np.int32)
  right = np.asarray([tokenizer.token_to_id(str(sum(map(int, p[:-1].split("+")))))
                      for p in prompts])
  canonical = trainer.strategy.to_canonical(state)
  logits = trainer.model_variables.apply(canonical.params, canonical.model_state,
                                         ((ids,), {}), rngs={"dropout": jax.random.key(0)},
                                         train=False)[0]
  probs = jax.nn.softmax(np.asarray(logits)[:, -1], axis=-1)
  return float(np.mean(np.asarray(probs)[np.arange(len(prompts)), right]))


def test_it_learns_single_digit_addition(task):
  """The example's config: from near chance (0.1) to an expected reward of at least 0.9
  within its 400 steps (G = 32; with 16 a group often holds one answer only, and some
  seeds stall below 0.9)."""
  from trainer.rl import RLTrainer
  from trainer.rl import data as rl_data
  config = rl_config(task, **{"rl.num_generations": 32, "batch_size": 32,
                              "num_train_steps": 400})
  trainer = RLTrainer(config)
  stream = rl_data.from_config(config)
  state = trainer.init_state(next(stream()))
  before = expected_reward(trainer, state, task)
  result = trainer.fit(stream, num_steps=400, state=state)
  after = expected_reward(trainer, result.state, task)
  assert before < 0.2 and after >= 0.9, (before, after)


def _resume_run(workdir, out, log, *extra):
  import os
  import subprocess
  import sys
  return subprocess.run([sys.executable, str(ROOT / "tests" / "rl_resume_run.py"),
                         f"--workdir={workdir}", f"--out={out}", *extra],
                        env={**os.environ, "RL_ROLLOUT_LOG": str(log)},
                        capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("task_flags", [(), ("--tools",)], ids=["addition", "tools"])
def test_a_run_killed_at_and_past_a_checkpoint_redraws_its_rollouts_bitwise_equal(
    tmp_path, task_flags):
  """SIGKILLed right after the checkpoint of step 4, then 3 steps past it (checkpoints every
  4), rerun each time: every attempt's rollouts are the uninterrupted run's from the step
  it resumed at, and the final state is the uninterrupted run's, bit for bit. With tools,
  each rollout's tool turn (its environment seeded from the step and the row) is redrawn
  too."""
  import json
  import signal

  def rollouts(log):
    return [json.loads(line) for line in open(log)]

  straight = _resume_run(tmp_path / "straight", tmp_path / "straight.npz", tmp_path / "s.log",
                         *task_flags)
  assert straight.returncode == 0, straight.stderr[-3000:]
  want = rollouts(tmp_path / "s.log")
  assert len(want) == 8 and len({json.dumps(r) for r in want}) == 8  # A new draw each step.
  work, out = tmp_path / "work", tmp_path / "final.npz"
  for attempt, (kill, kill_at, resumed_at) in enumerate(
      [("kill_after_save_at", 4, 0), ("kill_at", 7, 4), ("kill_at", -1, 4)]):
    log = tmp_path / f"attempt{attempt}.log"
    run = _resume_run(work, out, log, f"--{kill}={kill_at}", *task_flags)
    if kill_at > 0:
      assert run.returncode == -signal.SIGKILL, run.stderr[-3000:]
    else:
      assert run.returncode == 0, run.stderr[-3000:]
    if resumed_at:
      assert f"Resuming at step {resumed_at}" in run.stderr
    got = rollouts(log)  # Killed at S: steps resumed_at + 1 .. S drawn (a later one may be).
    assert len(got) >= (kill_at if kill_at > 0 else 8) - resumed_at
    assert got == want[resumed_at:resumed_at + len(got)], attempt
  a, b = np.load(tmp_path / "straight.npz"), np.load(out)
  assert sorted(a) == sorted(b)
  for key in a:
    np.testing.assert_array_equal(a[key], b[key], err_msg=key)  # Bit for bit.


def test_a_sweep_over_the_learning_rate_trains_each_member_as_its_own_run(task):
  """One ensemble program (each member's prompts split over 4 data devices, one reference
  copy for both: beta > 0) ends where
  each member's own single-device run ends: the same rollouts (a row's key is its index
  in the global batch), the same updates. SGD: its update is linear in the gradient, so
  the members' difference stays the gradients' float noise times the rate."""
  import jax

  from trainer.rl import RLTrainer
  from trainer.rl import data as rl_data
  rates = (0.1, 0.3)
  config = rl_config(task, optimizer="sgd", **{
      "strategy.name": "sharded_ensemble", "ensemble_size": 0, "rl.beta": 0.04,
      "strategy.ensemble_mesh_shape": (2, -1), "strategy.logical_axis_rules": ()})
  config.sweep.grid.learning_rate = rates
  config.sweep.metric, config.log_every_steps = "reward", 1
  trainer = RLTrainer(config)
  sink = Recorder()
  swept = trainer.fit(rl_data.from_config(config), num_steps=2, writer=sink)
  for step in (1, 2):  # Each member's train reward, under its label; their mean is the run's.
    each = [sink.scalars[step][f"train/learning_rate={r:g}/reward"] for r in rates]
    np.testing.assert_allclose(np.mean(each), sink.scalars[step]["train/reward"], rtol=1e-6)
  from strategies.sharded_ensemble import held_once
  assert all(held_once(x) for x in jax.tree.leaves(swept.state.reference))  # One reference.
  members = jax.device_get(trainer.strategy.to_canonical(swept.state).params)
  for i, rate in enumerate(rates):
    single = rl_config(task, optimizer="sgd", learning_rate=rate, **{"rl.beta": 0.04})
    result = RLTrainer(single).fit(rl_data.from_config(single), num_steps=2)
    jax.tree.map(lambda m, s, i=i: np.testing.assert_allclose(m[i], s, rtol=1e-5, atol=1e-6),
                 members, jax.device_get(result.state.params))


def test_harness_tasks_run_on_the_policy_during_rl(task, monkeypatch):
  """`trainer.harness.HarnessEval` as an action of an RL run under FSDP: lm-eval's tasks
  scored on the policy in its layout, and a generation, at the run's end."""
  pytest.importorskip("lm_eval")

  from trainer.harness import HarnessEval
  from trainer.rl import RLTrainer
  from trainer.rl import data as rl_data

  config = rl_config(task, "fsdp")
  trainer = RLTrainer(config)
  monkeypatch.chdir(ROOT)  # The tasks' data files are relative to the repository's root.
  sink = Recorder()
  action = HarnessEval(trainer, sink, ["docs_choice"], every_steps=100, tokenizer=task[1],
                       include_path=str(ROOT / "examples" / "harness_tasks"),
                       builtin_tasks=False, prompts=["3+4="], max_new_tokens=1)
  trainer.fit(rl_data.from_config(config), num_steps=2, actions=[action])
  assert 0.0 <= sink.latest("harness/docs_choice/acc") <= 1.0
  assert sink.latest("harness/generations").startswith("'3+4=' -> ")


def test_the_dry_run_shows_the_rollout_cache_and_the_update_per_device(task):
  """Under FSDP on 8 devices the rollout's 64 x 16 rows x 6 positions of keys and values (2
  layers, 4 heads of 16, float32) are split 8 ways; one update's temporaries and the cache
  each fit in the step's, which runs both."""
  import re

  from trainer.plan import make_plan
  from trainer.rl import RLTrainer
  from trainer.rl import data as rl_data
  config = rl_config(task, "fsdp", batch_size=64, **{"rl.num_generations": 16})
  trainer = RLTrainer(config)
  plan = make_plan(trainer, rl_data.example_batch(config))
  text = plan.report()
  mib = lambda name: float(re.search(rf"  {name} +([\d.,]+) MiB", text).group(1))  # noqa: E731
  rows, slots = 64 * 16, 5 + 1
  keys_and_values = 2 * 2 * rows * slots * 4 * 16 * 4  # layers, k and v, rows, slots, heads...
  assert f"({rows} rows x {slots} positions;" in text
  # The report's 2 decimals; the cache's write index (an int per row and layer) besides.
  np.testing.assert_allclose(mib("rollout cache"), keys_and_values / 8 / 2**20, atol=0.006)
  assert mib("update alone") <= mib("step temporaries")
  assert mib("rollout cache") <= mib("step temporaries")


@pytest.mark.parametrize("overrides,match", [
    ({"rl.num_generations": 1}, r"config\.rl\.num_generations=1 must be an integer >= 2"),
    ({"rl.beta": -0.1}, r"config\.rl\.beta=-0\.1 must be a number >= 0"),
    ({"rl.epsilon": 0.0}, r"config\.rl\.epsilon=0\.0 must be a number > 0"),
    ({"rl.num_iterations": 0}, r"config\.rl\.num_iterations=0 must be an integer >= 1"),
    ({"rl.max_completion_length": 8},
     r"config\.rl\.max_prompt_length=5 \+ max_completion_length=8 = 13 positions, more than "
     r"the model's config\.model\.max_len=8"),
    ({"rl.loss": "ppo"}, r"config\.rl\.loss='ppo' is not one of \('grpo', 'dr_grpo', 'dapo'\)"),
    ({"rl.max_record_bytes": 0}, r"config\.rl\.max_record_bytes=0 must be an integer >= 2"),
    ({"rl.log_completions": -1}, r"config\.rl\.log_completions=-1 must be an integer >= 0"),
    ({"rl.rewards": ("examples/rl_tasks.py:nothing_here",)},
     r"'examples/rl_tasks.py:nothing_here': the file examples/rl_tasks.py has no "
     r"'nothing_here'; name one of its functions \(addition_prompts, correct_sum"),
    ({"rl.rewards": ("examples/no_such_file.py:score",)},
     r"cannot import the reward function 'examples/no_such_file.py:score' \(no file "
     r".*examples/no_such_file.py\)"),
    ({"strategy.name": "pmap_data_parallel"}, r"RL generates its rollouts in the train step: "
                                              r"it runs under single_device, "
                                              r"sharded_data_parallel .* or, for a sweep, "
                                              r"sharded_ensemble"),
    ({"strategy.name": "sharded_data_parallel", "strategy.mesh_axes": ("data", "stage"),
      "strategy.mesh_shape": (2, -1)}, r"cannot be split over the 'stage' axis; it runs under "
                                       r"single_device or sharded_data_parallel"),
])
def test_refused_naming_the_field_before_any_compute(task, overrides, match):
  from trainer.rl import RLTrainer
  with pytest.raises(ValueError, match=match):
    RLTrainer(rl_config(task, **overrides))
