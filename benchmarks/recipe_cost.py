r"""What gradient accumulation and bfloat16 compute cost a train step, against the plain step.

    python benchmarks/recipe_cost.py [--rounds 10] [--block-seconds 1.0] [--workloads mnist,lm]
    python benchmarks/recipe_cost.py --lm-size gpu   # on one GPU: a 25M-parameter LM

Two workloads: the MNIST ensemble (`pmap_ensemble`, one CNN per device, batch
128 per member; with fewer devices than `--members`, `sharded_ensemble` puts
several members on a device) and the transformer LM
(`configs/lm.py:data_parallel`, jit over a data mesh of all devices; `--lm-size
test` is the config's own small model, batch 32; `gpu` a model large enough
to keep an accelerator busy). For each, the compiled train steps of the
same Trainer: plain, `grad_accum_steps` 2 and 4 (the same batch as 2 or 4
microbatches, in a `lax.scan` loop or unrolled: `grad_accum_loop`), and
`mixed_precision.compute_dtype=bfloat16`. In each
round every variant runs a block of equal step counts (the order rotates);
the figure is the median per-round ratio variant / plain with its
interquartile range, and XLA's temporary buffer size of each compiled step
(`memory_analysis().temp_size_in_bytes`): what accumulation saves.
"""

import argparse
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import choices  # noqa: E402  (benchmarks/, the script's own directory)

VARIANTS = {
    "plain": {},
    "accum2-scan": {"grad_accum_steps": 2, "grad_accum_loop": "scan"},
    "accum2-unroll": {"grad_accum_steps": 2, "grad_accum_loop": "unroll"},
    "accum4-scan": {"grad_accum_steps": 4, "grad_accum_loop": "scan"},
    "accum4-unroll": {"grad_accum_steps": 4, "grad_accum_loop": "unroll"},
    "bf16": {"mixed_precision.compute_dtype": "bfloat16"},
}


#: `--lm-size` -> overrides of `configs/lm.py:data_parallel`.
LM_SIZES = {
    "test": {},
    # 6 layers, width 512, 8 heads, sequences of 256, vocabulary 8192: 25M parameters.
    "gpu": {"model.vocab_size": 8192, "model.num_layers": 6, "model.embed_dim": 512,
            "model.num_heads": 8, "model.head_dim": 64, "model.mlp_dim": 2048,
            "model.max_len": 256, "seq_len": 256, "batch_size": 64},
}


def _workloads(batch_size_mnist: int, members: int, lm_size: str, lm_batch: int, lm_seq: int,
               lm_layers: int = 0):
  """key -> (title, trainer class, base config, one host batch)."""
  import jax
  from mnist_setup import MNISTTrainer, random_batches

  from configs import lm, mnist_ensemble
  from trainer import LanguageModelTrainer
  from trainer.language_model import synthetic_token_batches

  mnist = mnist_ensemble.get_config()
  mnist.ensemble_size = members
  mnist.batch_size = batch_size_mnist
  if members != jax.device_count():  # Several members per device (or a device each).
    mnist.strategy.name = "sharded_ensemble"
  lm_config = lm.get_config("data_parallel")
  lm_config.update_from_flattened_dict(LM_SIZES[lm_size])
  lm_config.batch_size = lm_batch or lm_config.batch_size
  lm_config.seq_len = lm_seq or lm_config.seq_len
  lm_config.model.num_layers = lm_layers or lm_config.model.num_layers
  lm_batch = next(synthetic_token_batches(0, lm_config.batch_size, lm_config.seq_len,
                                          lm_config.model.vocab_size))
  return {
      "mnist": (f"MNIST ensemble ({mnist.strategy.name} x{members})", MNISTTrainer, mnist,
                random_batches(batch_size_mnist, num=1)[0]),
      "lm": (f"Transformer LM {lm_size} (jit, data {jax.device_count()})",
             LanguageModelTrainer, lm_config, lm_batch),
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--rounds", type=int, default=10)
  parser.add_argument("--block-seconds", type=float, default=1.0)
  parser.add_argument("--batch", type=int, default=128, help="MNIST batch per member")
  parser.add_argument("--devices", type=int, default=8, help="host devices on a CPU-only machine")
  parser.add_argument("--members", type=int, default=8, help="MNIST ensemble members")
  parser.add_argument("--lm-size", choices=sorted(LM_SIZES), default="test")
  parser.add_argument("--lm-batch", type=int, default=0, help="LM batch (0: the size's)")
  parser.add_argument("--lm-seq", type=int, default=0, help="LM sequence length (0: the size's)")
  parser.add_argument("--lm-layers", type=int, default=0, help="LM layers (0: the size's)")
  parser.add_argument("--workloads", default="mnist,lm")
  parser.add_argument("--variants", default=",".join(VARIANTS),
                      help="which of the variants; 'plain' always runs")
  args = parser.parse_args()
  from trainer.distributed.devices import set_num_cpu_devices
  set_num_cpu_devices(args.devices)
  import jax
  from mnist_setup import compiled_run, rotating_rounds

  variants = choices.rows(parser, "--variants", args.variants, VARIANTS, baseline="plain")
  print(f"{jax.device_count()} {jax.devices()[0].platform} devices, {args.rounds} rounds")
  print(f"{'workload':<40} {'variant':<15} {'s/step':>8} {'vs plain':>9} {'middle half':>13} "
        f"{'temp MiB':>9}")
  workloads = _workloads(args.batch, args.members, args.lm_size, args.lm_batch,
                         args.lm_seq, args.lm_layers)
  unknown = set(args.workloads.split(",")) - set(workloads)
  if unknown:
    parser.error(f"--workloads: {sorted(unknown)} not among {sorted(workloads)}")
  for key in args.workloads.split(","):
    workload, cls, base, batch = workloads[key]
    runs, temp = {}, {}
    for variant in variants:
      config = base.copy_and_resolve_references()
      config.update_from_flattened_dict(VARIANTS[variant])
      runs[variant], temp[variant] = compiled_run(cls(config), batch)
    times = rotating_rounds(runs, "plain", rounds=args.rounds,
                            block_seconds=args.block_seconds, min_steps=3)
    for variant in variants:
      ratios = [t / p for t, p in zip(times[variant], times["plain"], strict=True)]
      q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
      print(f"{workload:<40} {variant:<15} {statistics.median(times[variant]):8.4f} "
            f"{statistics.median(ratios):8.3f}x {q[0]:6.3f}-{q[2]:.3f} {temp[variant]:9.2f}",
            flush=True)


if __name__ == "__main__":
  main()
