"""Rows at a user's lengths (512 and 1,024 tokens) with Grain's data workers on: every
process ends by itself, with no child left alive, after it finishes, after Ctrl-C and
after SIGKILL.

A block of such rows is larger than a pipe holds, so a worker writes it in pieces; a
worker killed half-way through one (as Linux's parent-death signal did when Grain's
prefetch thread ended at `close`) left `close` waiting for the rest for ever. Each
process here runs in a group of its own, as a terminal's job, and Ctrl-C goes to the
whole group, as a terminal sends it.
"""

import json
import os
import pathlib
import re
import signal
import sys

import corpus_files as cf
import numpy as np
import processes
import pytest

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
PY = sys.executable


@pytest.fixture(scope="module")
def long_corpus(tmp_path_factory):
  """`corpus_files`' word tokenizer and documents of 50 to 1,500 words."""
  root = cf.write_tokenizer(tmp_path_factory.mktemp("long"))
  sizes = np.random.default_rng(0).integers(50, 1500, size=120)
  cf.write_jsonl(root / "long.jsonl", [(d, int(n)) for d, n in enumerate(sizes)])
  return root


def _reader(root, workers, *extra):
  return [PY, str(HERE / "long_rows_run.py"), f"--root={root}", f"--workers={workers}",
          *extra]


@pytest.mark.parametrize("workers", [0, 1, 2])
def test_reading_long_rows_in_workers_ends_by_itself(long_corpus, workers):
  """512 then 1,024 tokens a row: every trained target is the next token of its document;
  the first iterator closed, the second left to the interpreter's exit."""
  rc, out, left = processes.run(_reader(long_corpus, workers), timeout=120)
  assert rc == 0, out[-3000:]
  assert re.search(r"length 512: \d+ targets checked", out), out[-3000:]
  assert re.search(r"length 1024: \d+ targets checked", out), out[-3000:]
  assert "READ" in out
  assert left == [], f"left alive: {left}\n{out[-3000:]}"


def test_a_killed_process_leaves_no_worker(long_corpus):
  """SIGKILL runs no cleanup: the workers see their parent gone and end."""
  proc = processes.start(_reader(long_corpus, 2, "--lengths=1024", "--hold"))
  lines = []
  for line in proc.stdout:
    lines.append(line)
    if "READ" in line:
      break
  workers = [int(p) for p in re.findall(r"\d+", "".join(lines).split("workers")[-1])]
  assert len(workers) >= 2, "".join(lines)  # Two workers (and the resource tracker).
  os.kill(proc.pid, signal.SIGKILL)
  proc.communicate(timeout=30)
  left = processes.left_after(proc.pid)
  assert left == [], f"left alive: {left}"


def test_ctrl_c_to_the_group_ends_the_reader_and_its_workers(long_corpus):
  """The workers leave Ctrl-C to the training process: none dies of it, none is left."""
  proc = processes.start(_reader(long_corpus, 2, "--lengths=1024", "--hold"))
  rc, out, left = processes.interrupt_after(proc, "READ", timeout=60)
  assert rc is not None, out[-3000:]
  assert "KeyboardInterrupt" in out  # The reader's own (it has no handler)...
  assert "grain-process-prefetch" not in out, out[-3000:]  # ... and no worker's.
  assert left == [], f"left alive: {left}\n{out[-3000:]}"


# -- The examples at a user's lengths --------------------------------------------------------

SHORT = ["--config.num_train_steps=2", "--config.log_every_steps=1",
         "--config.schedule.warmup_steps=0"]


def _example(name, workdir, *flags):
  """An example's command on one device: beside the suite's other worker on 2 cores, fake
  devices' collectives (FSDP's all-gathers inside the layers' loop) waited past XLA:CPU's
  rendezvous limit and aborted a run (`DESIGN.md`); the data workers under test, and the
  rows they make, are the same under any layout (the layouts' own tests run them)."""
  return [PY, str(ROOT / "examples" / name), f"--workdir={workdir}", "--num_cpu_devices=1",
          *flags, "--config.strategy.name=single_device"]  # After any --config=...


@pytest.fixture(scope="module")
def docs_corpus(tmp_path_factory):
  out = tmp_path_factory.mktemp("docs_corpus")
  rc, text, _ = processes.run([PY, str(ROOT / "examples" / "write_corpus.py"),
                               f"--out={out}"], timeout=120)
  assert rc == 0, text[-3000:]
  return out


def _long_runs(corpus):
  """Each example's command at a realistic length, data workers on."""
  return {
      "lm_1024_w2": ("transformer_lm.py", [
          f"--config.data.sources=('{corpus}/train-*.jsonl.gz',)",
          f"--config.data.eval_sources=('{corpus}/valid.jsonl',)",
          f"--config.data.tokenizer={corpus}", "--config.model.vocab_size=512",
          "--config.seq_len=1024", "--config.model.max_len=1024", "--config.batch_size=8",
          "--config.eval_batch_size=2", "--config.eval_every_steps=0",
          "--config.data.workers=2", *SHORT]),
      "finetune_512_w2": ("finetune_lm.py", [
          "--config.seq_len=512", "--config.model.max_len=512", "--config.eval_batch_size=4",
          "--config.data.workers=2", *SHORT]),
      "instruct_512_w1": ("finetune_lm.py", [
          "--config=configs/finetune_lm.py:instruct", "--config.seq_len=512",
          "--config.model.max_len=512", "--config.eval_batch_size=4",
          "--config.data.workers=1", *SHORT]),
      "preference_512_w1": ("preference_lm.py", [
          "--config.seq_len=512", "--config.model.max_len=512", "--config.data.workers=1",
          *SHORT]),
      "rl_512_w2": ("rl_lm.py", [
          "--config=configs/rl.py:finetuned", "--config.rl.max_prompt_length=512",
          "--config.model.max_len=528", "--config.data.workers=2", *SHORT]),
  }


@pytest.mark.parametrize("run", ["lm_1024_w2", "finetune_512_w2", "instruct_512_w1",
                                 "preference_512_w1", "rl_512_w2"])
def test_examples_at_long_rows_end_by_themselves(tmp_path, docs_corpus, run):
  """Each example trains at a realistic length with 1 or 2 workers (and held-out data:
  read in the training process whatever the workers) and exits 0 by itself."""
  script, flags = _long_runs(docs_corpus)[run]
  rc, out, left = processes.run(_example(script, tmp_path / "work", *flags), timeout=400,
                                cwd=ROOT)
  assert rc == 0, out[-4000:]
  assert left == [], f"left alive: {left}\n{out[-3000:]}"
  config = json.loads((tmp_path / "work" / "config.json").read_text())
  assert config["data"]["workers"] >= 1


def test_ctrl_c_at_long_rows_stops_with_a_checkpoint(tmp_path):
  """The fine-tune example at 512 tokens, 2 workers: Ctrl-C to the group once the step has
  compiled stops the run at a step boundary with a checkpoint, and everything ends."""
  work = tmp_path / "work"
  proc = processes.start(_example(
      "finetune_lm.py", work, "--config.seq_len=512", "--config.model.max_len=512",
      "--config.eval_batch_size=4", "--config.data.workers=2", "--config.num_train_steps=500"),
      cwd=ROOT)
  rc, out, left = processes.interrupt_after(proc, "Train step compiled", timeout=300)
  assert rc == 0, out[-4000:]
  stopped = re.search(r"Stopped by SIGINT at step (\d+)", out)
  assert stopped, out[-4000:]
  assert (work / "checkpoints" / stopped.group(1)).is_dir()
  assert "grain-process-prefetch" not in out and "KeyboardInterrupt" not in out, out[-4000:]
  assert left == [], f"left alive: {left}\n{out[-3000:]}"
