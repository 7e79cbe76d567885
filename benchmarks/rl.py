r"""An RL step's parts, and its rollout against `Generator` alone and a two-state loop.

    python benchmarks/rl.py [--layers 2] [--embed 128] [--prompts 8] [--group 8] \
        [--prompt-len 32] [--new 32] [--devices 8]

One GPT-2 (`--layers` x `--embed`, vocabulary `--vocab`) in the fine-tune example's FSDP
layout over the devices; `--prompts` random prompts of `--prompt-len` tokens, `--group`
completions each of up to `--new` tokens (sampled, temperature 1), a host reward over
the decoded completions, the KL to a frozen copy (`beta` 0.04), `--iterations` updates.
Each figure is the median of `--steps` calls (the best of `--repeats`, after one that
compiles); tokens count every row's `--new` budget.

The step's time split, each part compiled on its own under the same layout:

- `rl step`: `RLTrainer`'s train step, every part in one program (the whole);
- `rollout`: the completions (`Generator.program`: prefill and decode with a cache);
- `rewards`: the host's decoding and scoring of those completions;
- `old log-probs` and `reference`: one forward pass each, the policy's and the copy's;
- `update`: the optimizer update(s) on the rollouts (`steps.train`, times `--iterations`).

The rollout's tokens/s, side by side:

- `Generator alone`: `trainer.generation.Generator` called from the host on the same
  prompts (padding, the program, the tokens back as lists): the baseline;
- `rl step`: the whole step's rows x new tokens per second (rollout and update);
- `two-state loop`: what a separate sampler does, one step at a time: the policy's
  weights copied into the sampler's state (on device), the sampler's generation, the
  tokens to the host and scored, the log-probs and the update, each its own call.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PARTS = ("rollout", "rewards", "old log-probs", "reference", "update")


def even_tokens(*, completion_ids, **_):
  """The share of a completion's tokens that are even: a cheap host reward."""
  return [sum(1 for t in ids if t % 2 == 0) / max(len(ids), 1) for ids in completion_ids]


def write_tokenizer(directory: str, vocab: int) -> str:
  """A word-level tokenizer of `vocab` tokens (`<s>`, `</s>`, `t2`...), BOS before a prompt."""
  from tokenizers import Tokenizer, models, pre_tokenizers
  words = {"<s>": 0, "</s>": 1, **{f"t{i}": i for i in range(2, vocab)}}
  tokenizer = Tokenizer(models.WordLevel(words, unk_token="</s>"))
  tokenizer.add_special_tokens(["<s>", "</s>"])
  tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  path = os.path.join(directory, "tokenizer.json")
  tokenizer.save(path)
  with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
    json.dump({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}, f)
  return path


def make_config(args, tokenizer: str):
  import ml_collections

  from configs import lm, rl
  config = rl.get_config("addition")
  config.model = ml_collections.ConfigDict(dict(
      family="gpt2", vocab_size=args.vocab, num_layers=args.layers, embed_dim=args.embed,
      num_heads=max(args.embed // 64, 1), head_dim=None, mlp_dim=4 * args.embed,
      max_len=args.prompt_len + args.new, dropout_rate=0.0, vocab_multiple=None))
  config.data.tokenizer = tokenizer
  config.update(batch_size=args.prompts, log_every_steps=1000)
  config.mixed_precision.compute_dtype = args.compute_dtype
  config.rl.update(num_generations=args.group, num_iterations=args.iterations, beta=0.04,
                   reference="copy", max_prompt_length=args.prompt_len,
                   max_completion_length=args.new, rewards=(f"{__file__}:even_tokens",))
  shape, axes, rules = lm.LAYOUTS["fsdp"]
  config.strategy.update(name="sharded_data_parallel", mesh_shape=shape, mesh_axes=axes,
                         logical_axis_rules=rules)
  return config


def median_seconds(fn, args) -> float:
  """The best of `args.repeats` medians of `args.steps` calls of `fn()` (which blocks)."""
  fn()  # Compiles.
  best = float("inf")
  for _ in range(args.repeats):
    times = []
    for _ in range(args.steps):
      start = time.perf_counter()
      fn()
      times.append(time.perf_counter() - start)
    best = min(best, statistics.median(times))
  return best


def measure(args) -> dict[str, float]:
  import jax
  import jax.numpy as jnp
  import numpy as np

  from trainer.rl import RLTrainer
  from trainer.rl import losses as losses_lib
  from trainer.rl import trainer as rl_trainer
  from trainer.rl.data import PROMPT_IDS, PROMPT_LENGTHS

  directory = tempfile.mkdtemp(prefix="rl_bench_")
  config = make_config(args, write_tokenizer(directory, args.vocab))
  trainer = RLTrainer(config)
  strategy, rl = trainer.strategy, trainer.rl
  rng = np.random.default_rng(0)
  prompts = rng.integers(2, args.vocab, (args.prompts, args.prompt_len)).astype(np.int32)
  batch = {PROMPT_IDS: prompts, PROMPT_LENGTHS: np.full((args.prompts,), args.prompt_len,
                                                          np.int32)}
  state = trainer.init_state(batch)
  placed = strategy.put_batch(batch)
  rows = args.prompts * args.group
  figures = {}

  step = trainer.compiled.train(state)
  holder = [state]

  def rl_step():
    holder[0], _ = step(holder[0], placed)
    jax.block_until_ready(holder[0].params)

  figures["rl step"] = median_seconds(rl_step, args)
  state = holder[0]

  # The parts, each its own program under the same layout.
  repeated = {"tokens": jnp.repeat(placed[PROMPT_IDS], rl.num_generations, axis=0),
              "lengths": jnp.repeat(placed[PROMPT_LENGTHS], rl.num_generations, axis=0),
              "keys": jax.random.key_data(jax.random.split(jax.random.key(0), rows))}
  repeated = strategy.put_batch(jax.device_get(repeated))
  generate = strategy.compile_eval_step(trainer.generator.program(trainer.sampling), state)
  out = []

  def rollout():
    out[:] = [generate(state, repeated)]
    jax.block_until_ready(out[0])

  figures["rollout"] = median_seconds(rollout, args)
  new, counts, _ = jax.device_get(out[0])
  host = jax.device_get(repeated)
  figures["rewards"] = median_seconds(lambda: trainer._host_rewards(  # noqa: SLF001
      host["tokens"], host["lengths"], None, new, counts, 0, group=1), args)
  # The updates' batch as the step builds it (its rollouts, advantages and log-probs), in
  # the batch's layout.
  update = strategy.put_batch(jax.device_get(strategy.compile_eval_step(
      trainer.update_batch, state)(state, placed)))
  tokens = {k: update[k] for k in ("inputs", "targets")}
  logps = strategy.compile_eval_step(
      lambda s, b: trainer.logps(s.params, s.model_state, b["inputs"], b["targets"]), state)
  reference = strategy.compile_eval_step(
      lambda s, b: trainer.logps(s.reference, s.model_state, b["inputs"], b["targets"]), state)
  figures["old log-probs"] = median_seconds(
      lambda: jax.block_until_ready(logps(state, tokens)), args)
  figures["reference"] = median_seconds(
      lambda: jax.block_until_ready(reference(state, tokens)), args)
  train = strategy.compile_train_step(trainer.steps.train, state)
  holder[0] = jax.tree.map(jnp.copy, state)

  def updates():
    for _ in range(rl.num_iterations):
      holder[0], _ = train(holder[0], update)
    jax.block_until_ready(holder[0].params)

  figures["update"] = median_seconds(updates, args)

  # The rollout's tokens/s: the Generator from the host, and a loop over two states.
  lists = prompts.repeat(rl.num_generations, axis=0).tolist()
  figures["Generator alone"] = median_seconds(
      lambda: trainer.generator(state, lists, trainer.sampling), args)
  copy = jax.jit(lambda params: jax.tree.map(jnp.copy, params))
  sampler = [jax.tree.map(jnp.copy, state)]

  def two_state_loop():
    sampler[0] = sampler[0].replace(params=copy(holder[0].params))  # The weights' sync.
    new, counts, _ = jax.device_get(generate(sampler[0], repeated))
    total, _ = trainer._host_rewards(host["tokens"], host["lengths"], None,  # noqa: SLF001
                                     new, counts, 0, group=1)
    advantages = losses_lib.group_advantages(jnp.asarray(total), rl.num_generations)
    batch = dict(update)  # The rollout's rows (same shapes), its rewards and log-probs.
    batch[rl_trainer.ADVANTAGES] = strategy.put_batch(np.asarray(advantages))
    batch[rl_trainer.OLD] = logps(holder[0], tokens)
    batch[rl_trainer.REF] = reference(holder[0], tokens)
    for _ in range(rl.num_iterations):
      holder[0], _ = train(holder[0], batch)
    jax.block_until_ready(holder[0].params)

  figures["two-state loop"] = median_seconds(two_state_loop, args)
  figures["rows"] = rows
  return figures


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--layers", type=int, default=2)
  parser.add_argument("--embed", type=int, default=128)
  parser.add_argument("--vocab", type=int, default=512)
  parser.add_argument("--prompts", type=int, default=8)
  parser.add_argument("--group", type=int, default=8)
  parser.add_argument("--prompt-len", type=int, default=32)
  parser.add_argument("--new", type=int, default=32)
  parser.add_argument("--iterations", type=int, default=1)
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--repeats", type=int, default=2)
  parser.add_argument("--devices", type=int, default=8)
  parser.add_argument("--compute-dtype", default="float32")
  args = parser.parse_args()
  if (args.prompts * args.group) % args.devices or args.prompts % args.devices:
    parser.error(f"--prompts={args.prompts} must be a multiple of --devices={args.devices} "
                 f"(the prompts are split over the devices).")
  from trainer.distributed import devices
  devices.initialize(args.devices)
  import jax
  f = measure(args)
  tokens = f["rows"] * args.new
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind} x {len(jax.devices())}; "
        f"gpt2 {args.layers} x {args.embed}, {args.compute_dtype}; {args.prompts} prompts x "
        f"G={args.group} = {f['rows']} rows of {args.prompt_len} + {args.new} tokens; "
        f"{args.iterations} update(s)")
  print(f"{'part':<16} {'s/step':>9} {'of rl step':>11}")
  whole = f["rl step"]
  for part in ("rl step", *PARTS):
    print(f"{part:<16} {f[part]:>9.4f} {f[part] / whole:>10.2f}x")
  parts = sum(f[p] for p in PARTS)
  print(f"{'sum of parts':<16} {parts:>9.4f} {parts / whole:>10.2f}x")
  print(f"{'rollout':<16} {'s/step':>9} {'tokens/s':>11} {'vs Generator':>13}")
  base = tokens / f["Generator alone"]
  for row in ("Generator alone", "rollout", "rl step", "two-state loop"):
    rate = tokens / f[row]
    print(f"{row:<16} {f[row]:>9.4f} {rate:>11.0f} {rate / base:>12.2f}x")


if __name__ == "__main__":
  main()
