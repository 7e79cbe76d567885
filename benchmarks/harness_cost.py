r"""What the lm-evaluation-harness action costs against the training step it interrupts.

    python benchmarks/harness_cost.py [--layout data_tensor] [--steps 10] [--repeats 3]

The LM of `configs/lm.py` (a GPT-2 of `--layers` x `--embed`, `--layout` on 8 host
devices, batch 32 x 64 tokens) with a word-level tokenizer of its vocabulary, and the
repository's example tasks (`examples/harness_tasks`: 8 multiple-choice questions of 3
choices, 4 documents' perplexity; 28 requests). Printed side by side: one training step
(the median of `--steps` steps in `fit`), and one run of `trainer.harness.HarnessEval` on
the training state in its layout (the best of `--repeats`, after one that compiles),
with the task loading and the harness's own bookkeeping included.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _tokenizer(directory: str, vocab: int) -> str:
  """A word-level tokenizer of the example tasks' words (and `w<i>` fillers) up to `vocab`."""
  import glob

  from tokenizers import Tokenizer, decoders, models, pre_tokenizers
  words: dict[str, int] = {"<eos>": 0, "<unk>": 1}
  for path in sorted(glob.glob(os.path.join(ROOT, "examples", "harness_tasks", "*.jsonl"))):
    for line in open(path):
      for value in json.loads(line).values():
        for text in value if isinstance(value, list) else [value]:
          for word in str(text).split():
            if len(words) < vocab:
              words.setdefault(word, len(words))
  tokenizer = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
  tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tokenizer.decoder = decoders.WordPiece(prefix="##")
  path = os.path.join(directory, "tokenizer.json")
  tokenizer.save(path)
  with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
    json.dump({"eos_token": "<eos>"}, f)
  return path


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--layout", default="data_tensor")
  parser.add_argument("--layers", type=int, default=2)
  parser.add_argument("--embed", type=int, default=128)
  parser.add_argument("--vocab", type=int, default=256)
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--devices", type=int, default=8)
  args = parser.parse_args()
  from trainer.distributed import devices
  devices.initialize(args.devices)

  import jax
  import numpy as np

  from configs import lm
  from trainer import harness
  from trainer.language_model import LanguageModelTrainer
  from trainer.loop.actions import Action

  class StepClock(Action):
    """Records when each step's call returned."""

    def __init__(self):
      super().__init__(every_steps=1)
      self.times = []

    def run(self, view):
      jax.block_until_ready(view.state.params)
      self.times.append(time.perf_counter())

  config = lm.get_config(args.layout)
  config.model.update(family="gpt2", num_layers=args.layers, embed_dim=args.embed,
                      num_heads=max(args.embed // 32, 1), head_dim=None, mlp_dim=4 * args.embed,
                      vocab_size=args.vocab, max_len=64)
  config.seq_len = 64
  config.schedule.warmup_steps = 0
  config.log_every_steps = 1000
  with tempfile.TemporaryDirectory() as directory:
    tokenizer = _tokenizer(directory, args.vocab)
    trainer = LanguageModelTrainer(config)
    rng = np.random.default_rng(0)
    batches = [{"inputs": t, "targets": np.roll(t, -1, axis=1)} for t in (
        rng.integers(0, args.vocab, (config.batch_size, config.seq_len)).astype(np.int32)
        for _ in range(args.steps + 2))]
    clock = StepClock()
    result = trainer.fit(batches, num_steps=args.steps + 2, actions=[clock])
    step_s = statistics.median(np.diff(clock.times[1:]))  # The first call compiles.

    class Sink:
      def write_scalars(self, step, scalars):
        self.scalars = scalars

      def write_texts(self, step, texts):
        pass

    sink = Sink()
    action = harness.HarnessEval(
        trainer, sink, ["docs_choice", "docs_perplexity"], every_steps=1,
        tokenizer=tokenizer, include_path=os.path.join(ROOT, "examples", "harness_tasks"),
        builtin_tasks=False)

    class View:
      step = result.state.step
      state = result.state

    cwd = os.getcwd()
    os.chdir(ROOT)  # The tasks' data files are relative to the repository's root.
    try:
      start = time.perf_counter()
      action.run(View)
      first = time.perf_counter() - start
      best = float("inf")
      for _ in range(args.repeats):
        start = time.perf_counter()
        action.run(View)
        best = min(best, time.perf_counter() - start)
    finally:
      os.chdir(cwd)
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind} x {len(jax.devices())}; "
        f"gpt2 {args.layers} x {args.embed}, {args.layout}, batch {config.batch_size} x "
        f"{config.seq_len}; harness tasks docs_choice + docs_perplexity (28 requests)")
  print(f"{'run':<22} {'s':>9} {'vs step':>9}")
  print(f"{'train step':<22} {step_s:>9.4f} {1.0:>8.1f}x")
  print(f"{'harness action':<22} {best:>9.4f} {best / step_s:>8.1f}x")
  print(f"{'harness, first run':<22} {first:>9.4f} {first / step_s:>8.1f}x")
  print(f"acc {sink.scalars['harness/docs_choice/acc']:.3f}")


if __name__ == "__main__":
  main()
