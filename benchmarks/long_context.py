r"""What context parallelism buys: the LM's train step on one long sequence, on one device and
split over a `context` axis of 4 and 8 devices, by all-gather and by ring attention.

    python benchmarks/long_context.py [--seqs 1024,2048,4096] [--rounds 3]

For each sequence length: the transformer LM of `configs/lm.py` (2 layers, width 64,
8 heads of 8, or of `--head-dim`; one sequence per step) on one device (`none`, no
context axis, plain attention; with `--attention plain,blockwise` also `blockwise`,
`config.attention.method`; `blockwise:xla` or `blockwise:cudnn` also sets
`config.attention.implementation`), and under
`configs/lm.py:context` with `context=4` and `context=8` for each method. Printed per
run: XLA's temporaries per device of the compiled step (`memory_analysis()`: the
activations kept for the backward pass, the attention scores among them), the bytes
its collectives move per device (`trainer.plan.count_collective_bytes`), and the median
step time over rounds (the order rotating), each as a ratio to `none` at that length.
A run the config refuses (`blockwise:cudnn` where cuDNN cannot take the call), or whose
step fails to compile or run, prints why in place of its figures, and the others run.

On a CPU the fake devices share the machine's cores, so the step time is the methods'
total work and overhead, not what separate accelerators would take; the temporaries
per device are what each device would need.
"""

import argparse
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--seqs", default="1024,2048,4096", help="sequence lengths")
  parser.add_argument("--contexts", default="4,8",
                      help="context axis sizes ('': one device alone, no context axis)")
  parser.add_argument("--methods", default="all_gather,ring", help="attention methods")
  parser.add_argument("--attention", default="plain",
                      help="one-device attention methods (config.attention.method[:"
                           "implementation]): plain is `none`; e.g. plain,blockwise adds a "
                           "blockwise row per length, blockwise:cudnn one on cuDNN's kernel")
  parser.add_argument("--block-size", type=int, default=512, help="blockwise's block")
  parser.add_argument("--head-dim", type=int, default=8,
                      help="each head's width (8 heads; 8 is configs/lm.py's)")
  parser.add_argument("--compute-dtype", default="float32",
                      help="config.mixed_precision.compute_dtype (bfloat16: on a GPU, "
                           "blockwise runs as cuDNN's fused kernel where it can)")
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--block-seconds", type=float, default=1.0)
  args = parser.parse_args()
  contexts = [int(c) for c in args.contexts.split(",") if c]  # "": one device, no context axis.
  import jax

  from trainer.distributed.devices import set_num_cpu_devices
  set_num_cpu_devices(max(contexts, default=1))  # Whatever XLA_FLAGS the shell holds.
  from mnist_setup import compiled_run, rotating_rounds

  from configs import lm
  from strategies import ShardedDataParallel, context
  from trainer import LanguageModelTrainer
  from trainer.language_model import synthetic_token_batches
  from trainer.plan import count_collective_bytes

  print(f"{jax.devices()[0].device_kind} ({jax.devices()[0].platform}), "
        f"{len(jax.devices())} devices; LM 2 layers x 64, 8 heads of {args.head_dim}; "
        f"{args.compute_dtype}; one sequence per step; {args.rounds} rounds")
  print(f"{'seq':>6} {'run':<21} {'temp MiB/dev':>13} {'vs none':>8} {'coll MiB/dev':>13} "
        f"{'s/step':>8} {'vs none':>8}")
  for seq in (int(s) for s in args.seqs.split(",")):
    variants = {"none": ("data_parallel", 1, None, "plain")}
    for one_device in args.attention.split(","):
      if one_device != "plain":
        variants[one_device] = ("data_parallel", 1, None, one_device)
    for c in contexts:
      for method in args.methods.split(","):
        variants[f"context={c} {method}"] = ("context", c, method, "plain")
    runs, temp, moved = {}, {}, {}
    refused = {}
    for name, (layout, size, method, attention) in variants.items():
      config = lm.get_config(layout)
      config.update(seq_len=seq, batch_size=1, eval_batch_size=1)
      config.model.update(max_len=seq, head_dim=args.head_dim)
      attention, _, implementation = attention.partition(":")
      config.attention.update(method=attention, block_size=args.block_size,
                              implementation=implementation or "auto")
      config.mixed_precision.compute_dtype = args.compute_dtype
      strategy = None
      if method is None:
        config.strategy.name = "single_device"
      else:  # The first `size` devices.
        config.strategy.mesh_shape = (1, size)
        config.strategy.context.method = method
        strategy = ShardedDataParallel(
            config.strategy.mesh_shape, config.strategy.mesh_axes,
            config.strategy.logical_axis_rules, devices=jax.devices()[:size],
            context=context.config_fields(config))
      trainer = LanguageModelTrainer(config, strategy=strategy)
      batch = next(synthetic_token_batches(0, 1, seq, config.model.vocab_size))
      try:
        runs[name], temp[name] = compiled_run(trainer, batch)
      except ValueError as e:  # The config refused it while tracing (see the docstring).
        refused[name] = f"refused: {str(e).splitlines()[0]}"
        continue
      except Exception as e:  # noqa: BLE001 -- a kernel XLA could not compile or run.
        if name == "none":
          raise
        refused[name] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
        continue
      moved[name] = sum(count_collective_bytes(runs[name][0].as_text()).values()) / 2**20
    times = rotating_rounds(runs, "none", rounds=args.rounds, block_seconds=args.block_seconds,
                            min_steps=1)
    for name in variants:
      if name in refused:
        print(f"{seq:>6} {name:<21} {refused[name]}", flush=True)
        continue
      ratios = [t / b for t, b in zip(times[name], times["none"], strict=True)]
      print(f"{seq:>6} {name:<21} {temp[name]:13.1f} {temp[name] / temp['none']:7.3f}x "
            f"{moved[name]:13.2f} {statistics.median(times[name]):8.4f} "
            f"{statistics.median(ratios):7.2f}x", flush=True)


if __name__ == "__main__":
  main()
