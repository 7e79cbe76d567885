r"""How much of the device the transformer LM's train step uses: tokens/s, TFLOP/s and MFU,
beside a bare matmul on the same device in the same run.

    python benchmarks/lm_mfu.py [--sizes cpu] [--steps 5] [--repeats 3]
    python benchmarks/lm_mfu.py --sizes gpu,gpu_large   # on one GPU, bfloat16

For each size, the LM (`configs/lm.py`, one device) is compiled as `Trainer.fit`
compiles it; its FLOPs per step are its matrix products' in the step's jaxpr
(`trainer.throughput.StepFlops`, what `train/mfu` uses) and its step time
from blocks of steps (best of `--repeats`). The baseline is a jitted square
matmul in the compute dtype (`--matmul` wide): what the device reaches on its
best-shaped work. MFU is against the device's peak (`trainer.throughput`;
on CPU a measured float32 matmul).
"""

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

#: name -> overrides of `configs/lm.py:data_parallel` (single device).
SIZES = {
    # 4 layers x 256, seq 256, batch 16, float32: seconds a step on 2 CPU cores.
    "cpu": {"model.vocab_size": 1024, "model.num_layers": 4, "model.embed_dim": 256,
            "model.num_heads": 4, "model.head_dim": 64, "model.mlp_dim": 1024,
            "model.max_len": 256, "seq_len": 256, "batch_size": 16},
    # benchmarks/recipe_cost.py's GPU LM: 6 layers x 512, seq 256, batch 64, bfloat16 (25M).
    "gpu": {"model.vocab_size": 8192, "model.num_layers": 6, "model.embed_dim": 512,
            "model.num_heads": 8, "model.head_dim": 64, "model.mlp_dim": 2048,
            "model.max_len": 256, "seq_len": 256, "batch_size": 64,
            "mixed_precision.compute_dtype": "bfloat16"},
    # Wide enough for the matmuls to fill an H100: 12 layers x 2048, seq 1024, batch 16,
    # bfloat16, blocks rematerialised (740M parameters).
    "gpu_large": {"model.vocab_size": 32768, "model.num_layers": 12, "model.embed_dim": 2048,
                  "model.num_heads": 16, "model.head_dim": 128, "model.mlp_dim": 8192,
                  "model.max_len": 1024, "seq_len": 1024, "batch_size": 16,
                  "mixed_precision.compute_dtype": "bfloat16",
                  "remat.policy": "dots_with_no_batch_dims_saveable",
                  "remat.modules": ("DecoderBlock",)},
}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--sizes", default="cpu")
  parser.add_argument("--steps", type=int, default=5, help="steps per timed block")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--matmul", type=int, default=0, help="matmul width (0: 1024 CPU, 8192)")
  parser.add_argument("--layers", type=int, default=0, help="override the sizes' layers")
  parser.add_argument("--batch", type=int, default=0, help="override the sizes' batch")
  args = parser.parse_args()
  import jax
  import jax.numpy as jnp
  from mnist_setup import timed_block

  from configs import lm
  from trainer import LanguageModelTrainer, throughput
  from trainer.language_model import synthetic_token_batches

  device = jax.devices()[0]
  unknown = set(args.sizes.split(",")) - set(SIZES)
  if unknown:
    parser.error(f"--sizes: {sorted(unknown)} not among {sorted(SIZES)}")
  print(f"{device.device_kind} ({device.platform})")
  print(f"{'size':<10} {'dtype':<9} {'params':>8} {'GFLOP/step':>11} {'s/step':>8} "
        f"{'tokens/s':>10} {'TFLOP/s':>8} {'peak':>7} {'MFU':>6} {'matmul TFLOP/s':>15} "
        f"{'LM/matmul':>10}")
  for name in args.sizes.split(","):
    config = lm.get_config("data_parallel")
    config.update_from_flattened_dict(SIZES[name])
    config.strategy.name = "single_device"
    config.model.num_layers = args.layers or config.model.num_layers
    config.batch_size = args.batch or config.batch_size
    trainer = LanguageModelTrainer(config)
    batch = next(synthetic_token_batches(0, config.batch_size, config.seq_len,
                                         config.model.vocab_size))
    state = trainer.init_state(batch)
    placed = trainer.strategy.put_batch(batch)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                           sharding=x.sharding), state)
    flops = throughput.StepFlops(trainer.compiled.train(state),
                                 lambda args=(abstract, placed): args,
                                 num_devices=1)
    step = trainer.compiled.train(state)
    _, state = timed_block(step, state, placed, 2)  # Compiles and warms up.
    best = float("inf")
    for _ in range(args.repeats):
      seconds, state = timed_block(step, state, placed, args.steps)
      best = min(best, seconds / args.steps)
    dtype = config.mixed_precision.compute_dtype
    achieved = flops.total / best / 1e12
    peak = throughput.peak_tflops(device, dtype)
    width = args.matmul or (1024 if device.platform == "cpu" else 8192)
    matmul = throughput.matmul_tflops(
        width, jnp.float32 if dtype == "float32" else jnp.bfloat16, args.repeats)
    params = sum(x.size for x in jax.tree.leaves(state.params))
    tokens = config.batch_size * config.seq_len
    mfu = f"{achieved / peak:6.1%}" if peak else f"{'-':>6}"
    print(f"{name:<10} {dtype:<9} {params / 1e6:7.1f}M {flops.total / 1e9:11.1f} "
          f"{best:8.4f} {tokens / best:10.0f} {achieved:8.3f} {peak or 0:7.3g} {mfu} "
          f"{matmul:15.3f} {achieved / matmul:9.2f}x", flush=True)


if __name__ == "__main__":
  main()
