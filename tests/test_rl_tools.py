"""Tools and environments for multi-turn RL (`trainer.rl.tools`, `trainer.rl.multi_turn`):
schemas as `transformers` makes them, refusals before compute, and turns continued from
the key/value cache equal to running the whole context again."""

import enum
import pathlib
from typing import Literal

import hf_tokenizers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tool_setup as ts

from trainer.rl import tools


class Colour(enum.Enum):
  RED = "red"
  BLUE = "blue"


def plain(a: int, b: float, c: str, d: bool) -> str:
  """Four basic parameters.

  Args:
    a: an integer.
    b: a number
      spread over two lines.
    c: some text (choices: ["x", "y"])
    d: a flag.

  Returns:
    What it made.
  """
  return f"{a}{b}{c}{d}"


def containers(xs: list[int], table: dict[str, float], pair: tuple[int, str],
               maybe: int | None = None, either: int | str = 0) -> list:
  """Containers and unions.

  Args:
    xs: numbers.
    table: named numbers.
    pair: a number and a name.
    maybe: an optional number.
    either: a number or a name.
  """
  return xs


def choices(kind: Literal["a", "b", 3], colour: Colour) -> None:
  """Enums.

  Args:
    kind: a literal.
    colour: an Enum.
  """


@pytest.mark.parametrize("fn", [plain, containers, choices, ts.TableEnv().lookup])
def test_a_tools_schema_is_what_transformers_makes(fn):
  from transformers.utils import get_json_schema
  assert tools.schema_of(fn) == get_json_schema(fn)


def no_hints(key):
  """A tool.

  Args:
    key: a key.
  """


def no_doc(key: str) -> str:
  return key


def undocumented(key: str, other: int) -> str:
  """A tool.

  Args:
    key: a key.
  """


class NoReset:
  def lookup(self, key: str) -> str:
    """A tool.

    Args:
      key: a key.
    """


@pytest.mark.parametrize("specs,environment,match", [
    (("no_hints",), "", r"no_hints'.*the parameter 'key' has no type hint"),
    (("no_doc",), "", r"no_doc'.* has no docstring; a tool needs one"),
    (("undocumented",), "", r"undocumented'.*does not describe 'other'"),
    (("plain", "plain"), "", r"two tools are named 'plain'"),
    (("lookup",), "TableEnv", r"two tools are named 'lookup'"),
    ((), "NoReset", r"the class NoReset has no reset method"),
    ((), "plain", r"config.rl.environment=.*plain' is a function; it names a class"),
])
def test_bad_tools_are_refused_naming_them(specs, environment, match):
  here = pathlib.Path(__file__)
  with pytest.raises(tools.ToolError, match=match):
    tools.load([f"{here}:{s}" if s != "lookup" else f"{ts.__file__}:lookup" for s in specs],
               (f"{ts.__file__}:{environment}" if environment == "TableEnv" else
                f"{here}:{environment}") if environment else None)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
  root = tmp_path_factory.mktemp("tools")
  return ts.save("qwen", root / "qwen"), ts.write_records(root / "records.jsonl")


@pytest.mark.parametrize("override,match", [
    ({"rl.max_tool_calling_iterations": -1},
     r"config.rl.max_tool_calling_iterations=-1 must be an integer >= 0"),
    ({"strategy.name": "sharded_data_parallel", "strategy.mesh_shape": (2, 4),
      "strategy.mesh_axes": ("data", "stage")}, r"RL generates its rollouts in the train step"),
])
def test_bad_settings_are_refused_before_compute(qwen, override, match):
  from trainer.rl import RLTrainer
  with pytest.raises(ValueError, match=match):
    RLTrainer(ts.config(*qwen, **override))


def test_a_template_that_does_not_render_tools_is_refused(tmp_path):
  from trainer.rl import RLTrainer
  directory = hf_tokenizers.save("qwen", tmp_path / "plain_qwen")  # ChatML, no tools.
  records = ts.write_records(tmp_path / "records.jsonl")
  with pytest.raises(tools.ToolError, match=r"does not render the tools \['lookup'\]"):
    RLTrainer(ts.config(directory, records))


def test_turns_continued_from_the_cache_equal_the_whole_context_run_again(qwen):
  """The first turn scripted (a `lookup` call), every later token greedy from the model's
  logits in the rollout's loop, which feeds only new tokens through the cache; the same
  tokens chosen by running the whole context (prompt, call, tool turn, and what follows)
  through the model again at each position."""
  from trainer.generation import Generator
  from trainer.rl import RLTrainer
  from trainer.rl import data as rl_data
  directory, records = qwen
  config = ts.config(directory, records, **{"rl.max_completion_length": 48})
  trainer = RLTrainer(config)
  tokenizer = trainer.tokenizer.tokenizer
  call = tokenizer.encode('<tool_call>\n{"name": "lookup", "arguments": {"key": "ash"}}\n'
                          '</tool_call><|im_end|>', add_special_tokens=False).ids
  scripted = ts.script_policy([[call]] * 4)

  def policy(logits, keys, t, new, tool):
    first_turn = ~jnp.any(tool, axis=1)
    greedy = jnp.argmax(logits[:, :config.model.vocab_size], axis=-1).astype(jnp.int32)
    return jnp.where(first_turn, scripted(logits, keys, t, new, tool), greedy)

  trainer.multi_turn.policy = policy
  batch = next(rl_data.from_config(config, epochs=1)())
  state = trainer.init_state(batch)
  update = jax.device_get(jax.jit(trainer.update_batch)(state, trainer.strategy.put_batch(
      batch)))
  tokens = np.concatenate([update["inputs"], update["targets"][:, -1:]], axis=1)
  generator = Generator.from_trainer(trainer)
  eos = trainer.tokenizer.eos_id
  for r in range(tokens.shape[0]):
    n = int(batch["prompt_lengths"][r // 2])
    weights = update["completion_weights"][r]
    block_end = n + len(call) + int(np.argmax(weights[n - 1 + len(call):] > 0))
    assert block_end > n + len(call), "a tool turn follows the call"
    context = tokens[r, :block_end].tolist()
    for position in range(block_end, block_end + 12):  # Each from the whole context.
      logits = generator.logits(state, [context])[0][-1]
      context.append(int(np.argmax(logits)))
      assert tokens[r, position] == context[-1], (
          f"rollout {r}, position {position}: the turn after the tool's, from the cache")
      if context[-1] == eos:
        break


@pytest.mark.parametrize("layout", ["single_device", "fsdp", "data_tensor"])
def test_a_step_with_tool_turns_is_on_policy_and_logs_its_tools(qwen, layout):
  """Every rollout calls `lookup` in its first turn, then samples: the old log-probs and the
  first update's are one function of one state (float noise apart) on multi-turn rollouts
  too; each rollout's call counts (TRL's `tools/call_frequency`) and its turns."""
  from trainer import metrics as metrics_lib
  from trainer.rl import RLTrainer
  from trainer.rl import data as rl_data
  config = ts.config(*qwen, layout, batch_size=8 if layout == "fsdp" else 2,
                     **{"rl.beta": 0.05, "rl.max_completion_length": 48})
  trainer = RLTrainer(config)
  trainer.multi_turn.policy = ts.calling_policy(trainer)
  stream = rl_data.from_config(config)
  state = trainer.init_state(next(stream()))
  new, outputs = trainer.compiled.train(state)(state, trainer.strategy.put_batch(
      next(stream())))
  metrics = metrics_lib.scalars(jax.device_get(outputs["metrics"]))
  assert metrics["on_policy_gap"] <= 1e-5
  assert metrics["tools/call_frequency"] >= 1.0
  assert metrics["tools/failure_frequency"] == 0.0  # `ash` is in the table.
  assert metrics["tools/turns"] >= 2.0
  assert abs(metrics["kl"]) <= 1e-6
  assert int(new.step) == 1


def test_a_sweep_of_runs_with_tools_trains_each_member_as_its_own_run(tmp_path):
  """Two learning rates as one ensemble program, every rollout's first turn a `lookup` call:
  each member's host calls (its prompts, its turns, its rewards) are its own, and each
  member ends where its own single-device run ends (SGD: float noise times the rate)."""
  from trainer.rl import RLTrainer
  from trainer.rl import data as rl_data
  rates = (0.1, 0.3)

  def run(**overrides):
    config = ts.table_config(str(tmp_path / "task"))
    config.update(optimizer="sgd", batch_size=4)
    config.update_from_flattened_dict(overrides)
    trainer = RLTrainer(config)
    trainer.multi_turn.policy = ts.calling_policy(trainer, key="oak")
    return trainer, trainer.fit(rl_data.from_config(config), num_steps=2)

  config_sweep = {"strategy.name": "sharded_ensemble", "ensemble_size": 0,
                  "strategy.ensemble_mesh_shape": (2, -1), "strategy.logical_axis_rules": (),
                  "sweep.grid.learning_rate": rates}
  trainer, swept = run(**config_sweep)
  members = jax.device_get(trainer.strategy.to_canonical(swept.state).params)
  for i, rate in enumerate(rates):
    _, single = run(learning_rate=rate)
    jax.tree.map(lambda m, s, i=i: np.testing.assert_allclose(m[i], s, rtol=1e-5, atol=1e-6),
                 members, jax.device_get(single.state.params))


def test_the_tool_example_learns_a_task_only_the_tool_answers(tmp_path):
  """The documented command: a fresh model's held-out reward is 0 (it never calls the tool
  and cannot know a value it did not read); the warm start on demonstrations and RL take
  the train mean reward to 0.9 or more over the last 10 of its 60 steps, every rollout
  calling `lookup`."""
  import json
  import subprocess
  import sys

  from trainer.rl import RLTrainer
  from trainer.rl import data as rl_data
  root = pathlib.Path(__file__).resolve().parents[1]
  work = tmp_path / "work"
  run = subprocess.run([sys.executable, str(root / "examples" / "rl_lm.py"),
                        "--config=configs/rl.py:tools", f"--workdir={work}"], cwd=root,
                       capture_output=True, text=True, timeout=900)
  assert run.returncode == 0, run.stderr[-3000:]
  logged = [json.loads(line) for line in open(work / "metrics.jsonl")]
  rewards = {m["step"]: m["reward"] for m in logged if "reward" in m and "step" in m
             and "tools/call_frequency" in m}
  assert rewards[60] >= 0.9, rewards
  assert min(m["tools/call_frequency"] for m in logged if "tools/call_frequency" in m) > 0.9
  fresh = ts.table_config(str(work / "task"))  # The same task, from scratch.
  fresh.update(batch_size=4, eval_batch_size=4)
  trainer = RLTrainer(fresh)
  state = trainer.init_state(next(rl_data.from_config(fresh)()))
  assert trainer.evaluate(state, rl_data.eval_batches(fresh))["reward"] == 0.0
