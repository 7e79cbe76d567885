"""Rewards as TRL's docs write them (`trainer.rl.rewards`): they read the record's fields,
get conversations as turns, may return None, and their mistakes end a run once, with
their own message, before the step compiles where they can and at once on any layout
where they cannot. (`test_rl_trl.py` compares the arguments with TRL's own call.)"""

import json
import math
import os
import signal
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
import rl_setup
from rl_setup import ROOT, rl_config

from trainer.rl import losses, rewards

#: The addition tokenizer's chat template: the turns' text after BOS (its vocabulary is
#: digits, `+` and `=`), written where `transformers` 5 writes one.
CHAT_TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def task(tmp_path_factory):
  root = tmp_path_factory.mktemp("rl_records")
  prompts, tokenizer = rl_setup.write_task(root)
  (root / "chat_template.jinja").write_text(CHAT_TEMPLATE)
  return {"text": (rl_setup.write_records(root / "text.jsonl"), tokenizer),
          "chat": (rl_setup.write_records(root / "chat.jsonl", chat=True), tokenizer),
          "plain": (prompts, tokenizer)}


def _logged(log):
  return [json.loads(line) for line in open(log)]


@pytest.mark.parametrize("kind,layout", [("text", "fsdp"), ("chat", "single_device")])
def test_a_trl_reward_gets_every_field_of_its_record(task, kind, layout, tmp_path,
                                                     monkeypatch):
  """Two steps: each completion's `answer` and `level` are its prompt's record's, the
  prompt as the record holds it (text, or a conversation's turns), a conversation's
  completion as an assistant turn; TRL's `correct(completions, answer, **kwargs)` runs."""
  from trainer.rl import RLTrainer
  from trainer.rl import data as rl_data
  log = tmp_path / "calls.jsonl"
  monkeypatch.setenv("RL_REWARD_LOG", str(log))
  config = rl_config(task[kind], layout, **{
      "rl.rewards": ("rl_rewards:logged",) if kind == "chat" else (
          "rl_rewards:correct", "rl_rewards:logged")})
  trainer = RLTrainer(config)
  trainer.fit(rl_data.from_config(config), num_steps=2)
  calls = _logged(log)
  assert [c["step"] for c in calls] == [0, 0, 1]  # The check before compiling, then a step each.
  assert calls[0]["completions"] == ([""] * 8 if kind == "text"
                                     else [[{"role": "assistant", "content": ""}]] * 8)
  for call in calls[1:]:
    assert len(call["prompts"]) == 8 * 4
    for i, prompt in enumerate(call["prompts"]):
      text = prompt if kind == "text" else prompt[0]["content"]
      if kind == "chat":
        assert prompt == [{"role": "user", "content": text}]
        assert call["completions"][i][0]["role"] == "assistant"
        assert isinstance(call["completions"][i][0]["content"], str)
      else:
        assert isinstance(call["completions"][i], str)
      a, b = map(int, text.rstrip("=").split("+"))
      assert call["answer"][i] == str(a + b) and call["level"][i] == max(a, b)
    groups = [call["prompts"][i:i + 4] for i in range(0, 32, 4)]
    assert all(g.count(g[0]) == 4 for g in groups)  # A group shares its prompt.


def test_a_reward_may_return_none_where_it_does_not_apply():
  """None leaves a function out of a completion's weighted total; a completion no function
  applies to has no reward (NaN) and the warning says so."""
  funcs = rewards.load(["rl_rewards:odd_digits_only", "rl_rewards:length"], (2.0, 0.5))
  kwargs = rewards.arguments([{"prompt": "q"}] * 3, ["3", "4", "x1"], prompt_field="prompt",
                             prompt_ids=[[1]] * 3, completion_ids=[[5], [6], [7, 8]])
  total, each = rewards.score(funcs, kwargs)
  assert each["length"] == [1.0, 1.0, 2.0] and each["odd_digits_only"][0] == 1.0
  assert math.isnan(each["odd_digits_only"][1]) and math.isnan(each["odd_digits_only"][2])
  assert total == [2.0 + 0.5, 0.5, 1.0]
  none = rewards.load(["rl_rewards:never_applies"])
  total, _ = rewards.score(none, kwargs)
  assert all(math.isnan(t) for t in total)


def test_a_completion_without_a_reward_is_left_out_of_its_group():
  """Its group's mean and std are of the others' rewards; its advantage is 0 (TRL)."""
  rewards_ = jnp.asarray([1.0, np.nan, 0.0, 0.5, np.nan, np.nan, np.nan, np.nan])
  got = np.asarray(losses.group_advantages(rewards_, 4))
  kept = np.array([1.0, 0.0, 0.5])
  want = (kept - kept.mean()) / (kept.std(ddof=1) + losses.ADVANTAGE_EPS)
  np.testing.assert_allclose(got[[0, 2, 3]], want, rtol=1e-6)
  assert got[1] == 0.0 and (got[4:] == 0.0).all()


@pytest.mark.parametrize("reward,match", [
    ("rl_rewards:too_few", r"'too_few' \(rl_rewards:too_few\) returned 1 values for 8 "
                           r"completions"),
    ("rl_rewards:a_word", r"'a_word' \(rl_rewards:a_word\) returned 'no' for completion 1"),
    ("rl_rewards:correct", r"'correct' \(rl_rewards:correct\) raised TypeError: .*correct\(\) "
                           r"missing 1 required positional argument: 'answer'"),
])
def test_a_bad_reward_is_refused_before_the_step_compiles(task, reward, match):
  """One call on the first batch's prompts, with empty completions, when the trainer is
  built: refused there, before any compute (the records of `plain` have no `answer`)."""
  from trainer.rl import RLTrainer
  config = rl_config(task["plain"], **{"rl.rewards": (reward,)})
  with pytest.raises(rewards.RewardError, match=match):
    RLTrainer(config)


def test_a_reward_that_raises_mid_run_ends_it_at_once_on_eight_devices(tmp_path):
  """FSDP on 8 devices, a checkpoint every 4 steps, a reward that raises at step 6: the
  run ends with the reward's own message, once, with no collective left waiting and no
  abort; the checkpoint of step 4 is the last, untouched."""
  work = tmp_path / "work"
  run = subprocess.run(
      [sys.executable, str(ROOT / "tests" / "rl_resume_run.py"), f"--workdir={work}",
       f"--out={tmp_path / 'final.npz'}", "--reward=rl_rewards:fails_at_step"],
      env={**os.environ, "RL_ROLLOUT_LOG": str(tmp_path / "r.log"), "RL_FAIL_AT_STEP": "6"},
      capture_output=True, text=True, timeout=600)
  assert run.returncode not in (0, -signal.SIGABRT, 134), run.stderr[-3000:]
  message = ("'fails_at_step' (rl_rewards:fails_at_step) raised ZeroDivisionError: no "
             "reward at step 6")
  assert run.stderr.count(message) == 1, run.stderr[-3000:]
  assert "rendezvous" not in run.stderr and "JaxRuntimeError" not in run.stderr, (
      run.stderr[-3000:])
  assert sorted(os.listdir(work / "checkpoints")) == ["4"], os.listdir(work / "checkpoints")
  assert not (tmp_path / "final.npz").exists()


def test_sample_completions_reach_tensorboard_and_texts_jsonl(task, tmp_path):
  """Every `log_every_steps`, the latest rollout's first rows as TRL's completions table:
  each row's reward is its own completion's (the right sum: 1)."""
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

  from trainer import writers
  from trainer.rl import RLTrainer
  from trainer.rl import data as rl_data
  config = rl_config(task["text"], **{"rl.rewards": ("rl_rewards:correct",),
                                      "log_every_steps": 1, "rl.log_completions": 6})
  writer = writers.create_writer(str(tmp_path), ("tensorboard", "jsonl"))
  RLTrainer(config).fit(rl_data.from_config(config), num_steps=2, writer=writer)
  writer.close()
  tables = [json.loads(line) for line in (tmp_path / writers.TEXTS_NAME).read_text()
            .splitlines()]
  assert [(t["step"], t["name"]) for t in tables] == [(1, "completions"), (2, "completions")]
  for table in tables:
    lines = table["text"].splitlines()
    assert lines[2] == "| prompt | completion | reward | correct |" and len(lines) == 4 + 6
    for line in lines[4:]:
      prompt, completion, reward, correct = (c.strip() for c in line.split("|")[1:-1])
      a, b = map(int, prompt.rstrip("=").split("+"))
      assert float(reward) == float(correct) == float(completion == str(a + b))
  (events,) = tmp_path.glob("events.out.tfevents.*")
  accumulator = EventAccumulator(str(events), size_guidance={"tensors": 0})
  accumulator.Reload()
  assert [e.step for e in accumulator.Tensors("completions")] == [1, 2]


def test_a_record_longer_than_max_record_bytes_is_a_bad_record(task):
  """The whole record rides with its row; one that does not fit is named, not cut."""
  from trainer.data.corpus import Tokenizer
  from trainer.rl.data import RECORD, PromptEncoder, records_of
  encoder = PromptEncoder(Tokenizer(task["text"][1]), length=8, record_length=64)
  record = {"prompt": "3+4=", "answer": "7"}
  kind, rows = encoder(record)
  assert kind is None and records_of(rows[0][RECORD][None]) == [record]
  kind, rows = encoder({**record, "solution": "seven " * 20})
  assert (kind, rows) == ("record_too_long", [])
  assert "config.rl.max_record_bytes=64" in encoder.describe(kind)


def test_an_eval_batch_padded_for_the_devices_scores_its_real_prompts_only(task):
  """5 held-out prompts a batch on 8 data devices: the 3 padding rows carry no record and
  reach no reward function; the mean is over the real prompts (a TRL reward that reads the
  answer would fail on a padding row)."""
  from trainer.rl import RLTrainer
  from trainer.rl import data as rl_data
  config = rl_config(task["text"], "fsdp", eval_batch_size=5,
                     **{"rl.rewards": ("rl_rewards:correct",)})
  trainer = RLTrainer(config)
  held_out = rl_data.eval_batches(config)
  assert held_out[0]["prompt_ids"].shape[0] == 5
  state = trainer.init_state(next(rl_data.from_config(config)()))
  reward = trainer.evaluate(state, held_out)["reward"]
  assert 0.0 <= reward <= 1.0
  assert len(trainer.predict(state, held_out[0])) == 5
