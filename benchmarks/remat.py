r"""What rematerialisation saves and costs: XLA's temporary memory and the step time of the LM
under each `config.remat` setting, against no remat.

    python benchmarks/remat.py [--size cpu] [--rounds 5] [--block-seconds 2]
    python benchmarks/remat.py --size gpu   # on one GPU: the 25M-parameter LM, bf16

The transformer LM (`configs/lm.py`, one device) compiled with each variant:
none; the whole forward pass checkpointed (`remat.policy` only); and each
`DecoderBlock` checkpointed on its own (`remat.modules=("DecoderBlock",)`,
inside `nn.scan`) with three policies. For each, XLA's temporary buffer size
of the compiled train step (`memory_analysis().temp_size_in_bytes`: the
activations kept for the backward pass live there) and the median step time
over rounds of equal step blocks (the order rotates), as ratios to none.
"""

import argparse
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import choices  # noqa: E402  (benchmarks/, the script's own directory)

BLOCKS = ("DecoderBlock",)
VARIANTS = {
    "none": {},
    "whole/nothing": {"remat.policy": "nothing_saveable"},
    "blocks/nothing": {"remat.policy": "nothing_saveable", "remat.modules": BLOCKS},
    "blocks/dots": {"remat.policy": "dots_saveable", "remat.modules": BLOCKS},
    "blocks/dots_no_batch": {"remat.policy": "dots_with_no_batch_dims_saveable",
                             "remat.modules": BLOCKS},
}

#: `--size` -> overrides of `configs/lm.py:data_parallel`.
SIZES = {
    # 8 layers, width 256, sequences of 256, batch 16: 6.4M parameters.
    "cpu": {"model.vocab_size": 1024, "model.num_layers": 8, "model.embed_dim": 256,
            "model.num_heads": 4, "model.head_dim": 64, "model.mlp_dim": 1024,
            "model.max_len": 256, "seq_len": 256, "batch_size": 16},
    # benchmarks/recipe_cost.py's GPU LM (25M parameters) at 12 layers, batch 64, bf16.
    "gpu": {"model.vocab_size": 8192, "model.num_layers": 12, "model.embed_dim": 512,
            "model.num_heads": 8, "model.head_dim": 64, "model.mlp_dim": 2048,
            "model.max_len": 256, "seq_len": 256, "batch_size": 64,
            "mixed_precision.compute_dtype": "bfloat16"},
}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--size", choices=sorted(SIZES), default="cpu")
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--block-seconds", type=float, default=2.0)
  parser.add_argument("--batch", type=int, default=0, help="LM batch (0: the size's)")
  parser.add_argument("--seq", type=int, default=0, help="sequence length (0: the size's)")
  parser.add_argument("--layers", type=int, default=0, help="decoder blocks (0: the size's)")
  parser.add_argument("--variants", default=",".join(VARIANTS),
                      help="which of the variants; 'none' always runs")
  args = parser.parse_args()
  import jax
  from mnist_setup import compiled_run, rotating_rounds

  from configs import lm
  from trainer import LanguageModelTrainer
  from trainer.language_model import synthetic_token_batches

  variants = choices.rows(parser, "--variants", args.variants, VARIANTS, baseline="none")
  base = lm.get_config("data_parallel")
  base.update_from_flattened_dict(SIZES[args.size])
  base.strategy.name = "single_device"
  base.batch_size = args.batch or base.batch_size
  base.seq_len = args.seq or base.seq_len
  base.model.max_len = max(base.model.max_len, base.seq_len)
  base.model.num_layers = args.layers or base.model.num_layers
  batch = next(synthetic_token_batches(0, base.batch_size, base.seq_len, base.model.vocab_size))
  m = base.model
  print(f"{jax.devices()[0].device_kind} ({jax.devices()[0].platform}); LM {m.num_layers} "
        f"layers x {m.embed_dim}, mlp {m.mlp_dim}, seq {base.seq_len}, batch "
        f"{base.batch_size}, {base.mixed_precision.compute_dtype}; {args.rounds} rounds")
  print(f"{'variant':<22} {'temp MiB':>9} {'vs none':>8} {'s/step':>8} {'vs none':>8} "
        f"{'middle half':>13}")
  runs, temp = {}, {}
  for variant in variants:
    config = base.copy_and_resolve_references()
    config.update_from_flattened_dict(VARIANTS[variant])
    runs[variant], temp[variant] = compiled_run(LanguageModelTrainer(config), batch)
  times = rotating_rounds(runs, "none", rounds=args.rounds, block_seconds=args.block_seconds,
                          min_steps=2)
  for variant in variants:
    ratios = [t / p for t, p in zip(times[variant], times["none"], strict=True)]
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    print(f"{variant:<22} {temp[variant]:9.1f} {temp[variant] / temp['none']:7.2f}x "
          f"{statistics.median(times[variant]):8.4f} {statistics.median(ratios):7.3f}x "
          f"{q[0]:6.3f}-{q[2]:.3f}", flush=True)


if __name__ == "__main__":
  main()
