"""Reward functions the RL tests name by import path (`trainer.rl.rewards`)."""

import json
import os


def length(*, completions, **_):
  """The completion's length in characters."""
  return [float(len(c)) for c in completions]


def says_yes(*, completions, completion_ids, **_):
  """1 when the completion holds "yes" (and has ids), else 0."""
  return [1.0 if "yes" in c and ids else 0.0
          for c, ids in zip(completions, completion_ids, strict=True)]


def not_a_number(*, completions, **_):
  return [float("nan")] + [0.0] * (len(completions) - 1)


def too_few(*, completions, **_):
  return [0.0]


def a_string(*, completions, **_):
  return "ab"


def a_word(*, completions, **_):
  return [1.0] + ["no"] * (len(completions) - 1)


def correct(completions, answer, **kwargs):
  """A reward as TRL's docs write one: it reads the record's `answer`."""
  return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer, strict=True)]


NOT_CALLABLE = 3


def recorded(*, prompt_ids, completion_ids, **_):
  """0 for each completion; appends the call's prompts and completions (the ids) as one
  JSON line to the file `$RL_ROLLOUT_LOG` names: a run's rollouts, one line per step. (The
  check call before the step compiles, whose completions are all empty, is no rollout.)"""
  if not any(completion_ids):
    return [0.0] * len(completion_ids)
  with open(os.environ["RL_ROLLOUT_LOG"], "a") as f:
    f.write(json.dumps([prompt_ids, completion_ids]) + "\n")
  return [0.0] * len(completion_ids)


def logged(prompts, completions, completion_ids, trainer_state, **kwargs):
  """0 for each completion; appends the call's arguments (the step for `trainer_state`)
  as one JSON line to the file `$RL_REWARD_LOG` names."""
  with open(os.environ["RL_REWARD_LOG"], "a") as f:
    f.write(json.dumps({"prompts": prompts, "completions": completions,
                        "completion_ids": completion_ids, "step": trainer_state.global_step,
                        **kwargs}) + "\n")
  return [0.0] * len(completions)


def fails_at_step(completions, trainer_state, **kwargs):
  """0 for each completion, but raises at the step `$RL_FAIL_AT_STEP` names."""
  if trainer_state.global_step == int(os.environ.get("RL_FAIL_AT_STEP", "-1")):
    raise ZeroDivisionError(f"no reward at step {trainer_state.global_step}")
  return [0.0] * len(completions)


def odd_digits_only(completions, **kwargs):
  """1 for an odd digit, None (not applicable) for anything else."""
  return [1.0 if c.strip() in "13579" and c.strip() else None for c in completions]


def never_applies(completions, **kwargs):
  return [None] * len(completions)
