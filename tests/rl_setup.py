"""The RL tests' task (the example's single-digit addition) and their config."""

import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))  # rl_tasks: the addition task's reward.

import rl_tasks  # noqa: E402


def write_task(directory: pathlib.Path) -> tuple[str, str]:
  """The addition task's prompts (JSONL) and character tokenizer in `directory`."""
  return rl_tasks.write_addition(str(directory))


def write_records(path: pathlib.Path, *, chat: bool = False) -> str:
  """The addition prompts as records with more fields, as a TRL dataset holds them: the
  `answer` (the sum, a string) and the `level` (the larger digit); with `chat`, each
  prompt a conversation of one user turn."""
  with open(path, "w") as f:
    for prompt in rl_tasks.addition_prompts():
      a, b = map(int, prompt.rstrip("=").split("+"))
      text = [{"role": "user", "content": prompt}] if chat else prompt
      f.write(json.dumps({"prompt": text, "answer": str(a + b), "level": max(a, b)}) + "\n")
  return str(path)


def rl_config(task, layout="single_device", **overrides):
  """`configs/rl.py:addition`, small: 8 prompts x G=4 a step, under `layout` (a
  `configs/lm.py` layout, or single_device)."""
  from configs import lm, rl
  config = rl.get_config("addition")
  prompts, tokenizer = task
  config.data.update(sources=(prompts,), eval_sources=(prompts,), tokenizer=tokenizer,
                     workers=0, lanes=1)
  config.update(batch_size=8, eval_batch_size=8, num_train_steps=4, log_every_steps=1000)
  config.rl.num_generations = 4
  config.rl.rewards = (f"{ROOT / 'examples' / 'rl_tasks.py'}:correct_sum",)
  if layout != "single_device":
    shape, axes, rules = lm.LAYOUTS[layout]
    config.strategy.update(name="sharded_data_parallel", mesh_shape=shape, mesh_axes=axes,
                           logical_axis_rules=rules)
  config.update_from_flattened_dict(overrides)
  return config
