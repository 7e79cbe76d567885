r"""The transformer LM under pipeline layouts against data parallelism and FSDP, at equal global
batch: train-step time (ratio to data_parallel in the same run) and compiled memory per device.

    python benchmarks/pipeline.py [--devices 8] [--steps 10] [--batch 64] [--layers 8] \
        [--rows dp,fsdp,gpipe_m4,...]
    # On a machine with accelerators (every device it has; layouts that need more are skipped):
    python benchmarks/pipeline.py --devices 0

Each layout is `configs/lm.py:<layout>` with the same model (`--layers` decoder blocks,
`--embed` wide) and the same global batch; the pipeline rows differ in schedule and
microbatches. Memory is the dry run's (`trainer.plan.make_plan`: the compiled step's
arguments, temporaries and outputs on the fullest device); time is the mean of `--steps`
steps after compiling and two warm-up steps.

What a CPU can show: the schedule's cost in compute (in the bubble every stage still runs,
on filler, as in MaxText's pipeline, so a step does `(M + S - 1) / M` times a stage's
share of the work), the stage-to-stage permutes in the compiled program, how activation
memory changes with microbatches and remat, and the per-device parameter and optimizer
bytes. What it cannot: the 8 "devices" share the CPU's cores and memory, so a permute is a
memory copy and nothing overlaps; on accelerators a permute crosses the interconnect (the
reason to pipeline across slow links) and the comparison with FSDP's all-gathers turns on
that link's speed, so these step-time ratios say nothing about a GPU or TPU pod.
"""

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

#: row -> (configs/lm.py layout, config overrides). The first row run is the baseline.
ROWS = {
    "dp": ("data_parallel", {}),
    "fsdp": ("fsdp", {}),
    "gpipe_m4": ("pipeline", {"strategy.pipeline.microbatches": 4}),
    "gpipe_m16": ("pipeline", {"strategy.pipeline.microbatches": 16}),
    "gpipe_m4_remat": ("pipeline", {"strategy.pipeline.microbatches": 4,
                                    "strategy.pipeline.remat": True}),
    "gpipe_m16_remat": ("pipeline", {"strategy.pipeline.microbatches": 16,
                                     "strategy.pipeline.remat": True}),
    "circular_r2_m16": ("pipeline_circular", {"strategy.pipeline.microbatches": 16}),
    "tensor_2x2x2_m8": ("pipeline_tensor", {"strategy.pipeline.microbatches": 8}),
}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--devices", type=int, default=8,
                      help="host CPU devices to make (0: the machine's own devices)")
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--batch", type=int, default=64)
  parser.add_argument("--layers", type=int, default=8)
  parser.add_argument("--embed", type=int, default=128)
  parser.add_argument("--seq", type=int, default=64)
  parser.add_argument("--rows", default=",".join(ROWS),
                      help=f"comma-separated rows of {tuple(ROWS)}; the first is the baseline")
  args = parser.parse_args()

  if args.devices:
    from trainer.distributed.devices import set_num_cpu_devices
    set_num_cpu_devices(args.devices)

  import itertools

  import jax

  from configs import lm
  from strategies.pipeline import PipelineError
  from trainer.evaluation import wait_for_previous_call
  from trainer.language_model import LanguageModelTrainer, synthetic_token_batches
  from trainer.plan import make_plan

  n = jax.device_count()
  print(f"jax {jax.__version__}, backend {jax.default_backend()}, {n} devices; LM "
        f"{args.layers} layers x {args.embed} wide, sequence {args.seq}, global batch "
        f"{args.batch}, {args.steps} timed steps")
  results = []
  for name in args.rows.split(","):
    layout, overrides = ROWS[name]
    config = lm.get_config(layout)
    config.model.update(num_layers=args.layers, embed_dim=args.embed, num_heads=8,
                        head_dim=args.embed // 8, mlp_dim=4 * args.embed, max_len=args.seq)
    config.seq_len, config.batch_size, config.eval_batch_size = args.seq, args.batch, args.batch
    config.update_from_flattened_dict(overrides)
    try:
      trainer = LanguageModelTrainer(config)
    except (ValueError, PipelineError) as e:
      print(f"{name}: skipped on {n} devices ({str(e).splitlines()[0][:120]})")
      continue
    batches = list(itertools.islice(synthetic_token_batches(
        0, args.batch, args.seq, config.model.vocab_size), 4))
    plan = make_plan(trainer, batches[0])
    state = trainer.init_state(batches[0])
    step = trainer.strategy.compile_train_step(trainer.train_step, state)
    placed = [trainer.strategy.put_batch(b) for b in batches]
    for i in range(2):
      state, metrics = step(state, placed[i % len(placed)])
    jax.block_until_ready((state, metrics))
    start, outputs = time.perf_counter(), []
    for i in range(args.steps):
      state, metrics = step(state, placed[i % len(placed)])
      outputs.append(metrics)
      wait_for_previous_call(outputs)
    jax.block_until_ready((state, metrics))
    seconds = (time.perf_counter() - start) / args.steps
    pipeline = trainer.strategy.pipeline
    bubble = f"{pipeline.bubble_fraction:.1%}" if pipeline else "-"
    results.append((name, seconds, plan, bubble))

  base, first = results[0][1], results[0][0]
  mib = lambda b: b / 2**20  # noqa: E731
  print(f"{'row':18s} {'s/step':>8s} {'vs ' + first:>10s} {'bubble':>7s} {'params':>8s} "
        f"{'opt':>8s} {'temp':>8s} {'peak':>8s}  collectives (MiB per device)")
  for name, seconds, plan, bubble in results:
    collectives = ", ".join(f"{k} x{v}" for k, v in plan.collectives.items())
    print(f"{name:18s} {seconds:8.4f} {seconds / base:9.2f}x {bubble:>7s} "
          f"{mib(plan.params_bytes):8.2f} {mib(plan.opt_state_bytes):8.2f} "
          f"{mib(plan.temp_bytes):8.2f} {mib(plan.peak_bytes):8.2f}  {collectives}")


if __name__ == "__main__":
  main()
