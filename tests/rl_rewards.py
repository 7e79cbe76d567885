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


NOT_CALLABLE = 3


def recorded(*, prompt_ids, completion_ids, **_):
  """0 for each completion; appends the call's prompts and completions (the ids) as one
  JSON line to the file `$RL_ROLLOUT_LOG` names: a run's rollouts, one line per step."""
  with open(os.environ["RL_ROLLOUT_LOG"], "a") as f:
    f.write(json.dumps([prompt_ids, completion_ids]) + "\n")
  return [0.0] * len(completion_ids)
