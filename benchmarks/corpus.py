r"""The text corpus pipeline (`trainer.data.lm`): does it keep the LM fed, does its memory stay
flat as the corpus grows, does a resume cost the same late as early.

    python benchmarks/corpus.py [--sizes-mb 50,500] [--late 10000] [--batches 400]
                                [--workers 0,1,2]

Corpora are generated JSONL files of random documents (a word-level tokenizer of 4096
words, documents of 20-400 words), written once into `--dir`. Printed side by side:

1. **Throughput**: the pipeline's trained tokens/s on one process (the LM example's
   config: batch 32 x 64 tokens, packed, 8 lanes) for each `--workers` count (0: read
   and tokenized in the training process; n: in n Grain worker processes), against
   the tokens/s that the LM example's train step (`configs/lm.py:data_parallel`, 8
   host devices) consumes on this machine, timed on a placed batch. The ratio
   pipeline / step is the headroom; the reading process's CPU time per batch is what
   the training process itself spends on data.
2. **Memory**: the peak RSS of a process that reads `--batches` batches of each
   corpus size in-process (a subprocess each; the same work, only the files' size
   differs).
3. **Resume**: the seconds to restore a saved position and read the next batch, at
   step 10 and at step `--late` (median of 5, batch 8 x 64, in-process: the seek
   alone, without a worker's start).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

VOCAB = 4096


def write_corpus(directory: str, megabytes: int, seed: int = 0) -> str:
  """`directory/corpus-<MB>/` of 4 JSONL shards totalling about `megabytes` MB."""
  import numpy as np
  out = os.path.join(directory, f"corpus-{megabytes}")
  done = os.path.join(out, "done")
  if os.path.exists(done):
    return out
  os.makedirs(out, exist_ok=True)
  rng = np.random.default_rng(seed)
  words = np.array([f"w{i}" for i in range(VOCAB - 3)])
  target = megabytes * 2**20 // 4
  for shard in range(4):
    with open(os.path.join(out, f"part-{shard}.jsonl"), "w") as f:
      written = 0
      while written < target:
        lines = []
        for n in rng.integers(20, 401, size=256):
          lines.append(json.dumps({"text": " ".join(words[rng.integers(0, len(words), n)])}))
        block = "\n".join(lines) + "\n"
        f.write(block)
        written += len(block)
  write_tokenizer(out)
  open(done, "w").close()
  return out


def write_tokenizer(directory: str) -> None:
  from tokenizers import Tokenizer, models, pre_tokenizers
  vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(VOCAB - 3)}}
  tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
  tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tokenizer.save(os.path.join(directory, "tokenizer.json"))
  with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
    json.dump({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}, f)


def config_for(corpus: str, batch_size: int = 32, seq_len: int = 64, workers: int = 0):
  from configs import lm
  config = lm.get_config("data_parallel")
  config.model.vocab_size = VOCAB
  config.seq_len, config.batch_size = seq_len, batch_size
  config.data.update(sources=(corpus,), tokenizer=corpus, workers=workers)
  return config


def pipeline_tokens_per_second(corpus: str, batches: int, workers: int) -> tuple[float, float]:
  """(tokens/s, CPU milliseconds the reading process spends per batch)."""
  from trainer.data import lm
  iterator = lm.from_config(config_for(corpus, workers=workers))()
  try:
    next(iterator)  # Workers started, files opened, first rows packed.
    start, cpu, tokens = time.perf_counter(), time.process_time(), 0
    for _ in range(batches):
      batch = next(iterator)
      tokens += int((batch["segment_ids"] > 0).sum())
    cpu_ms = (time.process_time() - cpu) * 1000 / batches
    return tokens / (time.perf_counter() - start), cpu_ms
  finally:
    iterator.close()


def step_tokens_per_second(corpus: str) -> float:
  from mnist_setup import compiled_run, timed_block

  from trainer import LanguageModelTrainer
  from trainer.data import lm
  config = config_for(corpus)
  batch = next(lm.from_config(config)())
  trainer = LanguageModelTrainer(config)
  run, _ = compiled_run(trainer, batch)
  seconds, _ = timed_block(*run, 20)
  return 20 * float((batch["segment_ids"] > 0).sum()) / seconds


def peak_rss_mb(corpus: str, batches: int) -> float:
  """Peak RSS of a fresh process that reads `batches` batches (MiB)."""
  code = (f"import sys, resource; sys.path.insert(0, {ROOT!r}); "
          f"sys.path.insert(0, {os.path.join(ROOT, 'benchmarks')!r}); "
          f"import corpus as b; from trainer.data import lm; "
          f"it = lm.from_config(b.config_for({corpus!r}))(); "
          f"[next(it) for _ in range({batches})]; "
          f"print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
  done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        check=True)
  return int(done.stdout.strip().splitlines()[-1]) / 1024


def resume_seconds(corpus: str, step: int) -> tuple[float, float]:
  """(seconds to reach `step` by reading, median seconds to resume there)."""
  from trainer.data import lm
  corpus_ = lm.from_config(config_for(corpus, batch_size=8))
  iterator = corpus_()
  start = time.perf_counter()
  for _ in range(step):
    next(iterator)
  reading = time.perf_counter() - start
  state = json.loads(json.dumps(lm.gather_state(iterator.get_state())))
  times = []
  for _ in range(5):
    start = time.perf_counter()
    resumed = corpus_()
    resumed.set_state(state)
    next(resumed)
    times.append(time.perf_counter() - start)
  return reading, statistics.median(times)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--dir", default="/tmp/corpus_benchmark")
  parser.add_argument("--sizes-mb", default="50,500")
  parser.add_argument("--batches", type=int, default=400, help="batches per measurement")
  parser.add_argument("--late", type=int, default=10000, help="the late resume step")
  parser.add_argument("--workers", default="0,1,2", help="Grain worker counts to compare")
  args = parser.parse_args()
  from trainer.distributed.devices import set_num_cpu_devices
  set_num_cpu_devices(8)
  sizes = [int(s) for s in args.sizes_mb.split(",")]
  corpora = {mb: write_corpus(args.dir, mb) for mb in sizes}
  small = corpora[sizes[0]]
  step = step_tokens_per_second(small)
  print("throughput (tokens/s, one process; pipeline: batch 32 x 64, packed, 8 lanes)")
  print(f"  LM train step (data_parallel, 8 devices)  {step:12.0f}")
  for workers in (int(w) for w in args.workers.split(",")):
    pipeline, cpu_ms = pipeline_tokens_per_second(small, args.batches, workers)
    print(f"  pipeline, {workers} worker process(es)      {pipeline:12.0f}   "
          f"{pipeline / step:6.2f}x the step   {cpu_ms:6.2f} ms CPU/batch in the reader")
  print(f"peak RSS reading {args.batches} batches")
  base = None
  for mb, path in corpora.items():
    rss = peak_rss_mb(path, args.batches)
    base = base or rss
    print(f"  {mb:5d} MB corpus   {rss:8.1f} MiB   {rss / base:5.2f}x")
  print("resume (batch 8 x 64): seconds to read up to the step, median seconds to resume")
  first = None
  for at in (10, args.late):
    reading, resume = resume_seconds(small, at)
    first = first or resume
    print(f"  step {at:6d}   read {reading:8.2f} s   resume {resume:7.4f} s   "
          f"{resume / first:5.2f}x")


if __name__ == "__main__":
  main()
