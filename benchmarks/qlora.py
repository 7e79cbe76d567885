r"""What QLoRA's quantized base costs and saves: the same LoRA run with its frozen base in
float32 (the models' own dtype, the baseline), cast to bfloat16, in NF4 and in int8
(`config.lora.base_dtype`, blocks of 64).

    python benchmarks/qlora.py [--families gpt2,llama] [--rounds 3]

For each family (GPT-2: Linen, Qwix dequantizes each weight where its product is;
Llama: NNX, the whole base dequantized before the call), a model of `--layers` x
`--width` (heads of 64, MLP 4x, vocabulary 8,192), LoRA rank 16 on every attention and
MLP kernel, one device, `--batch` sequences of `--seq` tokens per step. Printed per
base: the dry run's parameter bytes (`trainer.plan`: 4-bit codes at half a byte) and
the base weights' bytes as stored (codes with their scales), each against the same
model with those weights in bf16; XLA's step temporaries; the median step time over
rounds (the order rotating), as a ratio to the float32 base's.
"""

import argparse
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

TARGETS = {"gpt2": (".*attn/c_attn/kernel", ".*attn/c_proj/kernel", ".*mlp/c_fc/kernel",
                    ".*mlp/c_proj/kernel"),
           "llama": (".*self_attn/[qkvo]_proj/kernel", ".*mlp/(gate|up|down)_proj/kernel")}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--families", default="gpt2,llama")
  parser.add_argument("--bases", default="bfloat16,nf4,int8",
                      help="bases beside float32 (config.lora.base_dtype)")
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--width", type=int, default=512)
  parser.add_argument("--seq", type=int, default=256)
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--block-seconds", type=float, default=2.0)
  args = parser.parse_args()
  import jax
  import ml_collections
  from mnist_setup import compiled_run, rotating_rounds

  from configs import lm
  from trainer import LanguageModelTrainer
  from trainer.language_model import synthetic_token_batches
  from trainer.plan import make_plan

  vocab, heads = 8192, args.width // 64
  print(f"{jax.devices()[0].device_kind} ({jax.devices()[0].platform}); {args.layers} layers x "
        f"{args.width}, {heads} heads, vocabulary {vocab}; LoRA rank 16; {args.batch} x "
        f"{args.seq} tokens per step; {args.rounds} rounds")
  print(f"{'family':<7} {'base':<9} {'params MiB':>11} {'vs bf16':>8} {'base MiB':>14} "
        f"{'vs bf16':>8} {'temp MiB':>9} {'s/step':>8} {'vs f32':>7}")
  for family in args.families.split(","):
    model = dict(family=family, vocab_size=vocab, num_layers=args.layers,
                 embed_dim=args.width, num_heads=heads, mlp_dim=4 * args.width,
                 max_len=args.seq)
    if family == "gpt2":
      model.update(layer_norm_epsilon=1e-5, dropout_rate=0.0)
    else:
      model.update(num_kv_heads=heads, head_dim=64)
    runs, temp, rows = {}, {}, {}
    for base in ["", *args.bases.split(",")]:
      config = lm.get_config("data_parallel")
      config.strategy.name = "single_device"
      config.update(seq_len=args.seq, batch_size=args.batch, eval_batch_size=args.batch)
      config.model = ml_collections.ConfigDict(model)
      config.lora.update(rank=16, alpha=32.0, targets=TARGETS[family], base_dtype=base,
                         block_size=64)
      trainer = LanguageModelTrainer(config)
      batch = next(synthetic_token_batches(0, args.batch, args.seq, vocab))
      plan = make_plan(trainer, batch)
      name = base or "float32"
      runs[name], temp[name] = compiled_run(trainer, batch, aot=False)
      rows[name] = plan
    times = rotating_rounds(runs, "float32", rounds=args.rounds,
                            block_seconds=args.block_seconds, min_steps=1)
    reference = rows["float32"]
    # The quantizable weights' bytes in bf16, and the parameters with those in bf16 (the rest
    # as they are), from a quantized run's dry run.
    bf16 = next(plan.quantized[2] for plan in rows.values() if plan.quantized)
    bf16_total = reference.params_bytes - bf16 * 2 + bf16
    for name, plan in rows.items():
      held = plan.quantized[1] if plan.quantized else plan.params_bytes - (
          bf16_total - bf16)  # A float base: its weights' bytes as they are stored.
      ratios = [t / b for t, b in zip(times[name], times["float32"], strict=True)]
      print(f"{family:<7} {name:<9} {plan.params_bytes / 2**20:11.2f} "
            f"{plan.params_bytes / bf16_total:7.3f}x {held / 2**20:14.2f} {held / bf16:7.3f}x "
            f"{temp[name]:9.1f} {statistics.median(times[name]):8.4f} "
            f"{statistics.median(ratios):6.2f}x", flush=True)


if __name__ == "__main__":
  main()
