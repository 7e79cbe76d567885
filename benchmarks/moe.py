r"""What a mixture of experts costs per step: grouped products (`jax.lax.ragged_dot`) against
dense one-hot einsum dispatch, and against the dense model of the same active parameters.

    python benchmarks/moe.py [--experts 8,32] [--seq 256] [--batch 8] [--rounds 3] [--runs ...]

For each expert count (top-2): the transformer LM of `configs/lm.py` (2 layers, width
128, 8 heads) with SwiGLU experts of width 256 in every block, trained on one device:

- `dense`: the same LM with a dense MLP of width 768, the active parameters per token of
  two SwiGLU experts of 256 (2 x 3 x 128 x 256 = 2 x 128 x 768) (the baseline);
- `ragged dropless`: every token's 2 choices sorted by expert, `ragged_dot` products;
- `ragged capacity 1.25`: the same, each expert taking at most 1.25 x an even share of
  each sequence's choices;
- `einsum capacity 1.25`: the same capacity by one-hot dispatch and combine tensors
  `[batch, length, experts, capacity]` and einsums (GShard's form,
  `models.moe.einsum_experts`).

Printed per run: XLA's temporaries of the compiled step (`memory_analysis()`), and the
median step time over rounds (the order rotating), each as a ratio to `dense`.
"""

import argparse
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import choices  # noqa: E402  (benchmarks/, the script's own directory)

#: The runs, the baseline first (`--runs` picks among the others).
RUNS = ("dense", "ragged dropless", "ragged capacity 1.25", "einsum capacity 1.25")


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--experts", default="8,32", help="expert counts")
  parser.add_argument("--seq", type=int, default=256)
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--embed", type=int, default=128)
  parser.add_argument("--expert-width", type=int, default=256)
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--block-seconds", type=float, default=1.0)
  parser.add_argument("--runs", default=",".join(RUNS[1:]),
                      help=f"comma-separated runs besides `dense` (the baseline, always "
                           f"run) among {list(RUNS[1:])}")
  args = parser.parse_args()
  runs_chosen = choices.rows(parser, "--runs", args.runs, RUNS, baseline="dense")
  import jax
  from mnist_setup import compiled_run, rotating_rounds

  from configs import lm
  from trainer import LanguageModelTrainer
  from trainer.language_model import synthetic_token_batches

  top_k, width = 2, args.expert_width
  print(f"{jax.devices()[0].device_kind} ({jax.devices()[0].platform}); LM 2 layers x "
        f"{args.embed}, experts of width {width}, top-{top_k}; batch {args.batch} x "
        f"{args.seq} tokens; one device; {args.rounds} rounds")
  print(f"{'experts':>7} {'run':<22} {'temp MiB':>9} {'vs dense':>9} {'s/step':>8} "
        f"{'vs dense':>9}")
  for experts in (int(e) for e in args.experts.split(",")):
    variants = {
        "dense": dict(mlp_dim=3 * top_k * width // 2),
        "ragged dropless": dict(num_experts=experts),
        "ragged capacity 1.25": dict(num_experts=experts, capacity_factor=1.25),
        "einsum capacity 1.25": dict(num_experts=experts, capacity_factor=1.25,
                                     moe_dispatch="einsum"),
    }
    variants = {name: variants[name] for name in runs_chosen}
    runs, temp = {}, {}
    for name, fields in variants.items():
      config = lm.get_config("data_parallel")
      config.strategy.name = "single_device"
      config.update(seq_len=args.seq, batch_size=args.batch, eval_batch_size=args.batch)
      config.model.update(embed_dim=args.embed, max_len=args.seq, mlp_dim=width,
                          num_experts_per_tok=top_k)
      for key, value in fields.items():
        config.model[key] = value
      trainer = LanguageModelTrainer(config)
      batch = next(synthetic_token_batches(0, args.batch, args.seq, config.model.vocab_size))
      runs[name], temp[name] = compiled_run(trainer, batch)
    times = rotating_rounds(runs, "dense", rounds=args.rounds,
                            block_seconds=args.block_seconds, min_steps=1)
    for name in variants:
      ratios = [t / b for t, b in zip(times[name], times["dense"], strict=True)]
      print(f"{experts:>7} {name:<22} {temp[name]:9.1f} {temp[name] / temp['dense']:8.2f}x "
            f"{statistics.median(times[name]):8.4f} {statistics.median(ratios):8.2f}x",
            flush=True)


if __name__ == "__main__":
  main()
