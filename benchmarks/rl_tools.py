r"""Multi-turn RL with tools: turns continued from the cache against the prefix run again,
and a step's parts.

    python benchmarks/rl_tools.py [--layers 2] [--embed 128] [--prompts 4] [--group 4] \
        [--turns 4] [--context 0] [--steps 3] [--repeats 2]

The table task of `configs/rl.py:tools` (`examples/tool_tasks.py`: its character
tokenizer, chat template and `Table` environment) on a GPT-2 of `--layers` x `--embed`,
single device. Every rollout is scripted (`trainer.rl.multi_turn.scripted`): `--turns`
assistant turns that each call `lookup`, then an answer, so both rollouts below take the
same tool turns and produce the same tokens; the model runs on every one of them.
`--context` puts that many tokens of text before each question (the prompt's length is
what the prefix loop pays again at each turn).

The rollout, side by side (completion tokens per second, tool turns included):

- `cache`: `trainer.rl.multi_turn` in one program: each token, sampled or a tool
  turn's, runs through the key/value cache once; a host call where a turn ends;
- `prefix again`: each turn a new `Generator` program over the whole context so far
  (prompt, earlier turns, tool turns) and then the turn's tokens, as a loop without
  prefix caching does (TRL's): the context's prefill is paid again at every turn.

A multi-turn RL step's time, each part compiled on its own:

- `rl step`: `RLTrainer`'s train step (one program: rollout, tools, rewards, log-probs,
  update);
- `rollout`: the multi-turn program alone (tool calls included);
- `tools`: the host's share of the rollout (`Episodes`: rendering the prompts, reading
  the turns, calling the tools, the tool turns' ids), timed on the host;
- `log-probs`: one forward pass over the rollouts;
- `update`: the optimizer update.

Each figure is the median of `--steps` calls, the best of `--repeats` (after one that
compiles).
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "examples")]


def median_seconds(fn, args) -> float:
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


def make_trainer(args):
  import ml_collections
  import tool_tasks

  from configs import rl
  from trainer.rl import RLTrainer
  directory = tempfile.mkdtemp(prefix="rl_tools_bench_")
  tokenizer, prompts, _ = tool_tasks.write_task(directory, demonstrations=1)
  if args.context:  # Each question after a long user turn: the agent's usual context.
    import json
    records = [json.loads(line) for line in open(prompts)]
    with open(prompts, "w") as f:
      for r in records:
        turn = r["prompt"][-1]
        r["prompt"][-1] = {**turn, "content": "x" * args.context + " " + turn["content"]}
        f.write(json.dumps(r) + "\n")
  config = rl.get_config("tools")
  del config["warm_start"]
  completion = 32 * (args.turns + 1)
  config.model = ml_collections.ConfigDict(dict(
      family="gpt2", vocab_size=64, num_layers=args.layers, embed_dim=args.embed,
      num_heads=max(args.embed // 64, 1), head_dim=None, mlp_dim=4 * args.embed,
      max_len=64 + args.context + completion, dropout_rate=0.0, vocab_multiple=None))
  config.data.update(sources=(prompts,), tokenizer=tokenizer, workers=0, lanes=1)
  config.update(batch_size=args.prompts, log_every_steps=1000)
  config.mixed_precision.compute_dtype = args.compute_dtype
  config.rl.update(num_generations=args.group, max_completion_length=completion,
                   max_prompt_length=64 + args.context,
                   max_tool_calling_iterations=args.turns, log_completions=0)
  return RLTrainer(config)


def script(trainer, turns: int) -> list[list[int]]:
  """`turns` calls of `lookup` (keys in turn), then an answer: one rollout's turns."""
  import tool_tasks
  encode = trainer.tokenizer.tokenizer.encode
  calls = [f'<tool_call>{{"name": "lookup", "arguments": {{"key": "{k}"}}}}</tool_call>'
           f"<|im_end|>" for k in tool_tasks.KEYS[:turns]]
  return [encode(text, add_special_tokens=False).ids for text in [*calls, "7<|im_end|>"]]


class Timed:
  """Wraps `Episodes`' host methods, summing the seconds they take."""

  def __init__(self, episodes):
    self.seconds = 0.0
    for name in ("start", "turn", "close"):
      method = getattr(episodes, name)

      def timed(*a, method=method, **k):
        start = time.perf_counter()
        try:
          return method(*a, **k)
        finally:
          self.seconds += time.perf_counter() - start

      setattr(episodes, name, timed)


def measure(args) -> dict[str, float]:
  import jax
  import jax.numpy as jnp

  from trainer.generation import Sampling
  from trainer.rl import data as rl_data
  from trainer.rl import multi_turn

  trainer = make_trainer(args)
  turns = script(trainer, args.turns)
  rows = args.prompts * args.group
  trainer.multi_turn.policy = multi_turn.scripted([turns] * rows)
  batch = next(rl_data.from_config(trainer.config)())
  state = trainer.init_state(batch)
  strategy = trainer.strategy
  placed = strategy.put_batch(batch)
  figures = {}

  # The rollout from the cache: the multi-turn program (its host calls included).
  keys = jax.random.key_data(jax.random.split(jax.random.key(0), rows))
  rendered = {}

  def rollout(state, records):  # As the step runs it: prompts rendered, then the loop.
    prompts, _ = trainer.multi_turn.prompts(records, group=args.group, step=state.step,
                                            rows=jnp.arange(rows))
    new, counts, *_ = trainer.multi_turn.program()(state, {**prompts, "keys": keys})
    return prompts, new, counts

  program = jax.jit(rollout)

  def cached():
    prompts, new, counts = jax.device_get(program(state, placed["record"]))
    rendered.update(prompts=prompts, new=new, counts=counts)
    multi_turn.closed(trainer.multi_turn.episodes, int(prompts[multi_turn.HANDLE]), new,
                      counts)

  figures["cache"] = median_seconds(cached, args)
  counts = rendered["counts"]
  figures["tokens"] = int(counts.sum())

  # The prefix again: each turn one Generator program over the whole context so far.
  episodes = trainer.multi_turn.episodes
  lengths = rendered["prompts"]["lengths"]
  contexts = [rendered["prompts"]["tokens"][r, :lengths[r]].tolist() for r in range(rows)]
  new = rendered["new"]
  tool_turn = episodes.tool_turn([{"role": "tool", "name": "lookup", "content": "7"}])

  def prefix_again():
    context = [list(c) for c in contexts]
    for turn in turns:
      out = trainer.generator(state, context, Sampling(max_new_tokens=len(turn),
                                                       temperature=0.0))
      del out  # The tokens the model would have chosen; the script's are appended.
      context = [c + turn + tool_turn for c in context]

  figures["prefix again"] = median_seconds(prefix_again, args)
  assert new.shape[0] == rows

  # The step and its parts.
  step = trainer.compiled.train(state)
  holder = [state]

  def rl_step():
    holder[0], _ = step(holder[0], placed)
    jax.block_until_ready(holder[0].params)

  figures["rl step"] = median_seconds(rl_step, args)
  state = holder[0]  # The step donates the state it is given.
  timed = Timed(episodes)
  figures["rollout"] = median_seconds(cached, args)
  timed.seconds = 0.0
  calls = args.steps
  for _ in range(calls):
    cached()
  figures["tools"] = timed.seconds / calls
  update = strategy.put_batch(jax.device_get(jax.jit(trainer.update_batch)(state, placed)))
  tokens = {k: update[k] for k in ("inputs", "targets")}
  logps = strategy.compile_eval_step(
      lambda s, b: trainer.logps(s.params, s.model_state, b["inputs"], b["targets"]), state)
  figures["log-probs"] = median_seconds(
      lambda: jax.block_until_ready(logps(state, tokens)), args)
  train = strategy.compile_train_step(trainer.steps.train, state)

  def updates():
    holder[0], _ = train(holder[0], update)
    jax.block_until_ready(holder[0].params)

  figures["update"] = median_seconds(updates, args)
  figures["rows"] = rows
  return figures


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--layers", type=int, default=2)
  parser.add_argument("--embed", type=int, default=128)
  parser.add_argument("--prompts", type=int, default=4)
  parser.add_argument("--group", type=int, default=4)
  parser.add_argument("--turns", type=int, default=4)
  parser.add_argument("--context", type=int, default=0,
                      help="Tokens of text before each question (a longer prompt).")
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--repeats", type=int, default=2)
  parser.add_argument("--compute-dtype", default="float32")
  parser.add_argument("--devices", type=int, default=1)
  args = parser.parse_args()
  from trainer.distributed import devices
  devices.initialize(args.devices)
  import jax
  f = measure(args)
  print(f"{f['rows']} rollouts x {args.turns} tool turns, {f['tokens']} completion tokens; "
        f"{jax.devices()[0].device_kind}")
  print(f"{'rollout':<14}{'s':>9}{'tokens/s':>11}{'vs cache':>10}")
  for name in ("cache", "prefix again"):
    print(f"{name:<14}{f[name]:>9.4f}{f['tokens'] / f[name]:>11.0f}"
          f"{f['cache'] / f[name]:>9.2f}x")
  print(f"\n{'part':<14}{'s/step':>9}{'of step':>9}")
  for name in ("rl step", "rollout", "tools", "log-probs", "update"):
    print(f"{name:<14}{f[name]:>9.4f}{f[name] / f['rl step']:>8.2f}x")


if __name__ == "__main__":
  main()
