r"""A preference step against a fine-tuning step on the same tokens, and the reference's cost.

    python benchmarks/preference.py [--layers 2] [--embed 128] [--seq 128] [--pairs 8]

One GPT-2 (`--layers` x `--embed`, vocabulary `--vocab`) in the fine-tune example's FSDP
layout over the devices, and `--pairs` pairs of two `--seq`-token sequences (half
prompt, half response). Printed side by side, each the median step time of `--steps`
compiled steps (the best of `--repeats`, after one call that compiles):

- `sft`: `LanguageModelTrainer` on the same tokens as `2 x pairs` rows: the baseline;
- `dpo copy`: DPO, the reference a frozen copy (a second forward pass, no backward);
- `dpo precomputed`: DPO, the reference's log-probs in the batch (no second pass);
- `simpo`: SimPO, no reference;
- `sft lora` and `dpo lora adapters_off`: the same under rank-8 LoRA, the reference the
  base with the adapters off.

The last column is the reference's bytes per device held in the train state (a copy's
weights; none otherwise).
"""

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

ROWS = ("sft", "dpo copy", "dpo precomputed", "simpo", "sft lora", "dpo lora adapters_off")


def _config(args, row: str):
  import ml_collections

  from configs import preference
  config = preference.get_config("lora" if "lora" in row else "dpo")
  config.model = ml_collections.ConfigDict(dict(
      family="gpt2", vocab_size=args.vocab, num_layers=args.layers, embed_dim=args.embed,
      num_heads=max(args.embed // 64, 1), head_dim=None, mlp_dim=4 * args.embed,
      max_len=args.seq, dropout_rate=0.0, vocab_multiple=None))
  config.update(seq_len=args.seq, batch_size=args.pairs, log_every_steps=1000)
  config.schedule.warmup_steps = 0
  config.mixed_precision.compute_dtype = args.compute_dtype
  config.preference.loss = "simpo" if row == "simpo" else "sigmoid"
  config.preference.reference = {"dpo copy": "copy", "dpo precomputed": "precomputed",
                                 "dpo lora adapters_off": "adapters_off"}.get(row, "auto")
  if row.startswith("sft"):
    config.trainer = "trainer.language_model:LanguageModelTrainer"
    config.batch_size = 2 * args.pairs
    del config["preference"]
  return config


def _batch(args, row: str, rng):
  import numpy as np

  from trainer.preference import data as pdata
  shape = (args.pairs, 2, args.seq)
  tokens = rng.integers(0, args.vocab, (args.pairs, 2, args.seq + 1)).astype(np.int32)
  weights = np.zeros(shape, np.float32)
  weights[..., args.seq // 2:] = 1.0
  if row.startswith("sft"):
    return {"inputs": tokens[..., :-1].reshape(-1, args.seq),
            "targets": tokens[..., 1:].reshape(-1, args.seq)}
  batch = {"inputs": tokens[..., :-1], "targets": tokens[..., 1:],
           pdata.LOSS_WEIGHTS: weights, pdata.TARGET_MASK: np.ones(shape, np.float32),
           pdata.COMPLETION_TOKENS: weights.sum(-1)}
  if row == "dpo precomputed":
    batch[pdata.REF_LOGPS] = rng.normal(-args.seq, 1.0, shape[:2]).astype(np.float32)
  return batch


def time_row(args, row: str) -> tuple[float, int]:
  """(median seconds a step, the reference's bytes per device in the state)."""
  import jax
  import numpy as np

  from trainer.language_model import LanguageModelTrainer
  from trainer.plan import _sum
  from trainer.preference import PreferenceTrainer

  config = _config(args, row)
  trainer = (LanguageModelTrainer if row.startswith("sft") else PreferenceTrainer)(config)
  batch = _batch(args, row, np.random.default_rng(0))
  state = trainer.init_state(batch)
  reference = _sum(getattr(state, "reference", None))
  step = trainer.compiled.train(state)
  placed = trainer.strategy.put_batch(batch)
  state, _ = step(state, placed)  # Compiles.
  jax.block_until_ready(state.params)
  best = float("inf")
  for _ in range(args.repeats):
    times = []
    for _ in range(args.steps):
      start = time.perf_counter()
      state, _ = step(state, placed)
      jax.block_until_ready(state.params)
      times.append(time.perf_counter() - start)
    best = min(best, statistics.median(times))
  return best, reference


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--layers", type=int, default=2)
  parser.add_argument("--embed", type=int, default=128)
  parser.add_argument("--vocab", type=int, default=512)
  parser.add_argument("--seq", type=int, default=128)
  parser.add_argument("--pairs", type=int, default=8)
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--devices", type=int, default=8)
  parser.add_argument("--compute-dtype", default="float32")
  parser.add_argument("--rows", default=",".join(ROWS),
                      help=f"Comma-separated, of {ROWS}; the first is the baseline.")
  args = parser.parse_args()
  rows = [r.strip() for r in args.rows.split(",") if r.strip()]
  unknown = [r for r in rows if r not in ROWS]
  if unknown:
    parser.error(f"--rows: {unknown} not among {ROWS}")
  from trainer.distributed import devices
  devices.initialize(args.devices)
  import jax
  figures = {row: time_row(args, row) for row in rows}
  base = figures[rows[0]][0]
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind} x {len(jax.devices())}; "
        f"gpt2 {args.layers} x {args.embed}, {args.compute_dtype}; {args.pairs} pairs x 2 x "
        f"{args.seq} tokens (sft: {2 * args.pairs} rows of {args.seq})")
  print(f"{'row':<24} {'s/step':>9} {'vs ' + rows[0]:>10} {'reference MiB/dev':>18}")
  for row in rows:
    seconds, reference = figures[row]
    print(f"{row:<24} {seconds:>9.4f} {seconds / base:>9.2f}x {reference / 2**20:>18.2f}")


if __name__ == "__main__":
  main()
