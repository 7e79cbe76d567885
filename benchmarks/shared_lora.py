r"""A LoRA sweep over one copy of its base against stacked copies, and against separate runs.

    python benchmarks/shared_lora.py [--devices 8] [--layers 4] [--embed 256] \
        [--bytes-members 1,8,16,64] [--memory-gib 0.25] [--timing-members 16] [--steps 5]

The model: a Llama (`config.model.family = "llama"`) of `--layers` x `--embed`, rank-8
adapters on every attention and MLP projection, a sweep over the learning rate with one
seed, so the frozen base is the same in every member (`trainer.run.shared`). The two
layouts of one `sharded_ensemble` sweep: `shared` (`config.strategy.share_frozen =
"auto"`: the base held once, replicated) and `stacked` (`"none"`: each member holds its
own copy, the layout before sharing).

1. Dry run (`trainer.plan.make_plan`, nothing initialised), for each of `--bytes-members`
   on `--devices` devices (members split over them, `ensemble_mesh_shape = (gcd(members,
   devices), -1)`: one member has all devices as its data axis): the parameters' bytes and
   the step's peak bytes on the fullest device, shared against stacked.
2. The most members whose step fits `--memory-gib` per device (the dry run's verdict, as
   `python -m trainer.plan --memory_gib=...` gives it), doubling then bisecting.

The dry runs run the members a device holds as a `lax.map` loop (`--plan-loop`), one
member's temporaries at a time, the loop a many-member sweep would use.
3. Step time (`--timing-members` > 0): seconds per member-step of the sweep, shared and
   stacked, each the median of `--steps` calls after the one that compiles; and of
   `--timing-members` separate single-device runs of one member's config on the first
   device (`sweep_vs_runs.py`'s separate jobs), each compiling its own step.
"""

import argparse
import math
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

TARGETS = (".*self_attn/[qkvo]_proj/kernel", ".*mlp/(gate|up|down)_proj/kernel")


def config_for(args, members: int, share: str, devices: int, loop: str = ""):
  import numpy as np

  from configs import lm
  config = lm.get_config("data_parallel")
  config.model.update(family="llama", vocab_size=args.vocab, num_layers=args.layers,
                      embed_dim=args.embed, num_heads=max(1, args.embed // 64), head_dim=64,
                      num_kv_heads=max(1, args.embed // 128), mlp_dim=4 * args.embed,
                      max_len=args.seq)
  config.update(seq_len=args.seq, batch_size=args.batch, eval_batch_size=args.batch,
                optimizer="adamw", log_every_steps=10**6, ensemble_size=0)
  config.lora.update(rank=8, alpha=16.0, targets=TARGETS)
  config.schedule.warmup_steps = 0
  if members:
    config.strategy.update(name="sharded_ensemble", mesh_shape=(), mesh_axes=(),
                           logical_axis_rules=(), share_frozen=share,
                           ensemble_mesh_shape=(math.gcd(members, devices), -1),
                           ensemble_loop=loop)
    config.sweep.grid.learning_rate = tuple(float(x) for x in np.geomspace(1e-4, 1e-2,
                                                                            members))
    if members == 1:
      config.sweep.seeds = (0,)
      config.sweep.grid.learning_rate = ()
  else:
    config.strategy.name = "single_device"
  return config


def plan_of(args, members: int, share: str, memory: int | None = None):
  from trainer.language_model import LanguageModelTrainer, synthetic_token_batches
  from trainer.plan import make_plan
  trainer = LanguageModelTrainer(config_for(args, members, share, args.devices,
                                            args.plan_loop))
  batch = next(synthetic_token_batches(0, args.batch, args.seq, args.vocab))
  return make_plan(trainer, batch, device_memory=memory)


def most_members(args, share: str, memory: int, limit: int) -> int:
  """The most members (a multiple of the devices) whose step the dry run says fits."""
  fits = lambda m: plan_of(args, m, share, memory).fits  # noqa: E731
  unit = args.devices
  low, high = 0, unit
  while high <= limit and fits(high):
    low, high = high, high * 2
  high = min(high, limit + unit)
  while high - low > unit:  # Bisect over multiples of the devices.
    mid = (low + high) // 2 // unit * unit
    low, high = (mid, high) if fits(mid) else (low, mid)
  return low


def step_seconds(trainer, stream, steps: int) -> float:
  """The median seconds of `steps` train calls after the one that compiles."""
  import jax
  state = jax.block_until_ready(trainer.fit(stream, num_steps=1).state)
  times = []
  for step in range(2, steps + 2):
    tick = time.perf_counter()
    state = jax.block_until_ready(trainer.fit(stream, num_steps=step, state=state).state)
    times.append(time.perf_counter() - tick)
  return statistics.median(times)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--devices", type=int, default=8)
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--embed", type=int, default=256)
  parser.add_argument("--vocab", type=int, default=1024)
  parser.add_argument("--seq", type=int, default=64)
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--bytes-members", default="1,8,16,64")
  parser.add_argument("--memory-gib", type=float, default=0.25,
                      help="one device's memory for the most-members search (0: skip)")
  parser.add_argument("--max-members", type=int, default=1024)
  parser.add_argument("--plan-loop", default="map",
                      help="config.strategy.ensemble_loop of the dry runs (map: one member's "
                           "temporaries at a time, and a compile that does not grow with "
                           "the members)")
  parser.add_argument("--timing-members", type=int, default=16)
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--compute-dtype", default="float32")
  args = parser.parse_args()

  from trainer.distributed.devices import set_num_cpu_devices
  set_num_cpu_devices(args.devices)
  import jax
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind} ({jax.default_backend()}), "
        f"{args.devices} devices; Llama {args.layers} x {args.embed}, LoRA rank 8 on every "
        f"projection; rows {args.batch} x {args.seq}", flush=True)
  mib = lambda b: b / 2**20  # noqa: E731
  members_list = [int(m) for m in args.bytes_members.split(",") if m]
  if members_list:
    print(f"{'members':>8s} {'params MiB/device':>28s} {'step peak MiB/device':>28s}")
    print(f"{'':>8s} {'shared':>9s} {'stacked':>9s} {'ratio':>8s} "
          f"{'shared':>9s} {'stacked':>9s} {'ratio':>8s}")
  for m in members_list:
    shared, stacked = plan_of(args, m, "auto"), plan_of(args, m, "none")
    print(f"{m:8d} {mib(shared.params_bytes):9.2f} {mib(stacked.params_bytes):9.2f} "
          f"{stacked.params_bytes / shared.params_bytes:7.2f}x "
          f"{mib(shared.peak_bytes):9.2f} {mib(stacked.peak_bytes):9.2f} "
          f"{stacked.peak_bytes / shared.peak_bytes:7.2f}x", flush=True)
  if args.memory_gib:
    memory = int(args.memory_gib * 2**30)
    most = {share: most_members(args, share, memory, args.max_members)
            for share in ("auto", "none")}
    print(f"most members whose step fits {args.memory_gib:g} GiB per device (dry run, "
          f"multiples of {args.devices}, up to {args.max_members}): shared {most['auto']}, "
          f"stacked {most['none']}", flush=True)
  if args.timing_members:
    from trainer.language_model import LanguageModelTrainer, synthetic_token_batches

    def stream(start):
      return synthetic_token_batches(0, args.batch, args.seq, args.vocab, start)

    n = args.timing_members
    seconds = {}
    for share in ("auto", "none"):
      config = config_for(args, n, share, args.devices)
      config.mixed_precision.compute_dtype = args.compute_dtype
      seconds[share] = step_seconds(LanguageModelTrainer(config), stream, args.steps) / n
    sweep = LanguageModelTrainer(config_for(args, n, "auto", args.devices)).sweep
    separate = []
    for i in range(n):
      member = sweep.member_config(config_for(args, n, "auto", args.devices), i)
      member.update(ensemble_size=0)
      member.strategy.name = "single_device"
      member.sweep.grid.learning_rate = ()
      member.mixed_precision.compute_dtype = args.compute_dtype
      separate.append(step_seconds(LanguageModelTrainer(member), stream, args.steps))
    runs = statistics.mean(separate)
    print(f"{'s per member-step':>30s}")
    print(f"{'sweep, base shared':24s} {seconds['auto']:10.5f}")
    print(f"{'sweep, base stacked':24s} {seconds['none']:10.5f}  "
          f"({seconds['none'] / seconds['auto']:.2f}x shared's)")
    print(f"{f'{n} separate runs':24s} {runs:10.5f}  ({runs / seconds['auto']:.2f}x shared's;"
          f" each on one device)")


if __name__ == "__main__":
  main()
