r"""On-policy distillation against off-policy (supervised training on the teacher's own
samples), and a distillation step's cost against an SFT step on the same tokens.

    python benchmarks/distill.py --workdir /tmp/distill_bench [--steps 100] \
        [--timing-steps 5] [--devices 8] [--student-layers 2] [--student-embed 64] \
        [--teacher-layers 4] [--teacher-embed 128] [--teacher-steps 300]

Quality (`--steps` > 0): the example's setup (`examples/distill_lm.py`: its teacher, a
GPT-2 4 x 128 trained on the docs, and its records, a prompt per docs paragraph with the
teacher's sampled completion), and two students from the same random GPT-2 2 x 64, each
trained `--steps` steps of 16 prompts in the example's FSDP layout:

- `on-policy`: `configs/distill.py:onpolicy` (the student's own samples every step, the
  reverse KL);
- `off-policy`: the same trainer at `lmbda = 0` with the loss the student's cross-entropy
  on the records' completions (the teacher's samples): sequence-level KD, SFT on teacher
  outputs.

Both are measured on the held-out prompts by the distillation eval: `reverse_kl`, the
student's reverse KL to the teacher (T = 1) on its own samples, and `nll`, its negative
log-likelihood of the teacher's held-out completions.

Timing (`--timing-steps` > 0), on the same model and layout, each figure the median of
`--timing-steps` calls after one that compiles: the whole distillation step, its parts
(the student's sampling, the teacher's forward, the update), and an SFT step (the update
with the cross-entropy loss, no teacher) on the same tokens; and the teacher's bytes
stored as float32, int8 and NF4.
"""

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "examples")]


def supervised_trainer():
  """`DistillationTrainer` with the student's cross-entropy on the completions as the loss
  (TRL's reduction: summed over completion tokens, divided by their count)."""
  from trainer.distill import DistillationTrainer, losses
  from trainer.distill.trainer import WEIGHTS
  from trainer.generation import logits_of
  from trainer.preference.losses import token_logps

  class SupervisedOnSamples(DistillationTrainer):
    def loss(self, outputs, batch):
      nll = -token_logps(logits_of(outputs), batch["targets"], self.config.model.vocab_size)
      return losses.per_sequence(nll, batch[WEIGHTS])
  return SupervisedOnSamples


def base_config(args):
  """The example's config and files (`distill_lm.prepare`: the teacher trained, the records
  written, once per workdir), at the flags' sizes."""
  import distill_lm

  from configs import distill
  config = distill.get_config("onpolicy")
  heads = lambda embed: 4 if embed <= 128 else embed // 64  # noqa: E731  (GPT-2's 64 wide)
  config.model.update(num_layers=args.student_layers, embed_dim=args.student_embed,
                      num_heads=heads(args.student_embed), mlp_dim=4 * args.student_embed)
  config.teacher.update(num_layers=args.teacher_layers, embed_dim=args.teacher_embed,
                        num_heads=heads(args.teacher_embed), mlp_dim=4 * args.teacher_embed,
                        steps=args.teacher_steps)
  config.mixed_precision.compute_dtype = args.compute_dtype
  distill_lm.prepare(config, args.workdir)
  return config


def quality(args) -> dict:
  import ml_collections

  from trainer.distill import DistillationTrainer
  from trainer.distill import data as distill_data
  out = {}
  for name in ("on-policy", "off-policy"):
    config = base_config(args)
    config = ml_collections.ConfigDict(config.to_dict())
    config.num_train_steps = args.steps
    config.schedule.warmup_steps = min(config.schedule.warmup_steps, args.steps - 1)
    kind = DistillationTrainer
    if name == "off-policy":
      config.distill.lmbda = 0.0
      kind = supervised_trainer()
    trainer = kind(config)
    # Both judged by the distillation eval at lmbda = 1 (on the student's own samples).
    judge = trainer if name == "on-policy" else DistillationTrainer(ml_collections.ConfigDict(
        {**config.to_dict(), "distill": {**config.distill.to_dict(), "lmbda": 1.0}}))
    held = distill_data.eval_batches(config)
    start = time.perf_counter()
    state = trainer.init_state(held[0])
    before = judge.evaluate(state, held)
    result = trainer.fit(distill_data.from_config(config), num_steps=args.steps, state=state)
    after = judge.evaluate(result.state, held)
    out[name] = {"before": before, "after": after, "seconds": time.perf_counter() - start}
  return out


def median_seconds(fn, steps: int) -> float:
  fn()  # Compiles.
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def timing(args) -> dict:
  import jax
  import jax.numpy as jnp

  from trainer.distill import DistillationTrainer
  from trainer.distill import data as distill_data
  from trainer.distill.teacher import teacher_bytes
  config = base_config(args)
  trainer = DistillationTrainer(config)
  strategy = trainer.strategy
  batch = next(iter(distill_data.from_config(config)()))
  state = trainer.init_state(batch)
  placed = strategy.put_batch(batch)
  figures = {}
  step, holder = trainer.compiled.train(state), [jax.tree.map(jnp.copy, state)]

  def whole():
    holder[0], _ = step(holder[0], placed)
    jax.block_until_ready(holder[0].params)
  figures["distillation step"] = median_seconds(whole, args.timing_steps)
  on = trainer.distill.lmbda == 1.0
  completions = strategy.compile_eval_step(
      lambda s, b: trainer.completions(s, b, on_policy=on), state)
  figures["sampling"] = median_seconds(
      lambda: jax.block_until_ready(completions(state, placed)), args.timing_steps)
  update = strategy.put_batch(jax.device_get(strategy.compile_eval_step(
      trainer.update_batch, state)(state, placed)))
  teacher = strategy.compile_eval_step(lambda s, b: trainer.teacher_logps(s, b["inputs"]),
                                       state)
  figures["teacher forward"] = median_seconds(
      lambda: jax.block_until_ready(teacher(state, update)), args.timing_steps)
  for name, kind in (("update", DistillationTrainer), ("sft step", supervised_trainer())):
    other = trainer if kind is DistillationTrainer else kind(config)
    train = strategy.compile_train_step(other.steps.train, state)
    holder[0] = jax.tree.map(jnp.copy, state)

    def one(train=train):
      holder[0], _ = train(holder[0], update)
      jax.block_until_ready(holder[0].params)
    figures[name] = median_seconds(one, args.timing_steps)
  import ml_collections
  for dtype in ("", "int8", "nf4"):
    other = ml_collections.ConfigDict(config.to_dict())
    other.distill.update(teacher_dtype=dtype, teacher_block_size=16)  # 8 blocks: FSDP splits.
    stored = DistillationTrainer(other)
    abstract = stored.strategy.checkpoint_target(stored.states.abstract(batch))
    figures[f"teacher {dtype or 'float32'}"] = teacher_bytes(abstract.teacher)
  figures["rows"], figures["tokens"] = (config.batch_size, config.distill.max_prompt_length
                                        + config.distill.max_completion_length)
  return figures


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--workdir", required=True,
                      help="Where the teacher, the records and the students' base go.")
  parser.add_argument("--steps", type=int, default=100)
  parser.add_argument("--timing-steps", type=int, default=5)
  parser.add_argument("--devices", type=int, default=8)
  parser.add_argument("--student-layers", type=int, default=2)
  parser.add_argument("--student-embed", type=int, default=64)
  parser.add_argument("--teacher-layers", type=int, default=4)
  parser.add_argument("--teacher-embed", type=int, default=128)
  parser.add_argument("--teacher-steps", type=int, default=300)
  parser.add_argument("--compute-dtype", default="float32")
  args = parser.parse_args()
  from trainer.distributed import devices
  devices.initialize(args.devices)
  import jax
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind} x {len(jax.devices())}")
  if args.steps:
    q = quality(args)
    print(f"{args.steps} steps of 16 prompts, student gpt2 {args.student_layers} x "
          f"{args.student_embed}, teacher gpt2 {args.teacher_layers} x {args.teacher_embed}; "
          f"held-out, after (before)")
    print(f"{'':<12} {'reverse_kl':>20} {'nll':>20} {'seconds':>9}")
    for name, f in q.items():
      print(f"{name:<12} {f['after']['reverse_kl']:>10.4f} ({f['before']['reverse_kl']:.4f})"
            f" {f['after']['nll']:>10.4f} ({f['before']['nll']:.4f}) {f['seconds']:>9.1f}")
  if args.timing_steps:
    f = timing(args)
    print(f"{f['rows']} rows of up to {f['tokens']} tokens")
    print(f"{'part':<18} {'s/step':>9} {'of the step':>12}")
    whole = f["distillation step"]
    for part in ("distillation step", "sampling", "teacher forward", "update", "sft step"):
      print(f"{part:<18} {f[part]:>9.4f} {f[part] / whole:>11.2f}x")
    print(f"{'teacher':<18} {'MiB in all':>11} {'MiB/device':>11}")
    for dtype in ("float32", "int8", "nf4"):
      total, per_device = f[f"teacher {dtype}"]
      print(f"{dtype:<18} {total / 2**20:>11.3f} {per_device / 2**20:>11.3f}")


if __name__ == "__main__":
  main()
