r"""Decoding with a key/value cache against recomputing the whole window for every token.

    python benchmarks/generation.py [--new 32,256] [--batch 8] [--prompt 32] [--family gpt2]

One model (`configs/lm.py`'s LM at `--layers` x `--embed`, `--family`), one batch of
`--batch` prompts of `--prompt` tokens, greedy, on one device. Printed side by side per
number of new tokens:

- `cached`: `trainer.generation.Generator`, prefill and every decode step in one compiled
  program (a `lax.while_loop`), each step one token per row against the cache;
- `recompute`: the sampler `examples/finetune_lm.py` had before it, for the same batch:
  a host loop that runs the whole window (prompt and new tokens so far, padded to one
  length so it compiles once) through the model for every new token and reads the next
  token's logits back.

The tokens both choose agree up to each row's first near-tie, which their different
roundings can break apart (the `same tokens` column: the mean share of each row's new
tokens before the first difference). Times are the best of `--repeats` after a
warm-up call (compilation is reported apart); tokens/s counts new tokens of all rows.
The cache's size is printed too: its bytes per device under the layout (one device
here; `python -m trainer.plan` shows it for a config's mesh).
"""

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--new", default="32,256", help="new tokens per prompt, comma-separated")
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--prompt", type=int, default=32)
  parser.add_argument("--family", default="gpt2", choices=("transformer", "gpt2", "llama"))
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--embed", type=int, default=256)
  parser.add_argument("--vocab", type=int, default=1024)
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args()
  news = [int(n) for n in args.new.split(",")]

  import jax
  import jax.numpy as jnp
  import numpy as np

  from configs import lm
  from trainer.generation import Generator, Sampling, logits_of
  from trainer.language_model import LanguageModelTrainer

  config = lm.get_config("data_parallel")
  config.strategy.name = "single_device"
  heads = max(args.embed // 64, 1)
  config.model.update(family=args.family, num_layers=args.layers, embed_dim=args.embed,
                      num_heads=heads, head_dim=args.embed // heads, mlp_dim=4 * args.embed,
                      vocab_size=args.vocab, max_len=args.prompt + max(news))
  if args.family == "llama":
    config.model.num_kv_heads = heads
  config.batch_size = args.batch
  config.seq_len = args.prompt
  trainer = LanguageModelTrainer(config)
  rng = np.random.default_rng(0)
  prompts = rng.integers(0, args.vocab, (args.batch, args.prompt)).astype(np.int32)
  state = trainer.init_state({"inputs": prompts, "targets": prompts})
  generator = Generator.from_trainer(trainer)
  mv, vocab = trainer.model_variables, args.vocab

  @jax.jit
  def next_logits(params, model_state, window, position):
    logits, _ = mv.apply(params, model_state, ((window,), {}),
                         rngs={"params": jax.random.PRNGKey(0)}, train=False)
    logits = logits_of(logits)[..., :vocab]
    return jnp.take_along_axis(logits, position[:, None, None], axis=1)[:, 0]

  def recompute(steps):
    """The former example's loop: the whole window through the model for each token."""
    window = np.zeros((args.batch, args.prompt + steps), np.int32)
    window[:, :args.prompt] = prompts
    for t in range(steps):
      position = np.full((args.batch,), args.prompt + t - 1, np.int32)
      chosen = np.asarray(jnp.argmax(next_logits(state.params, state.model_state, window,
                                                 position), axis=-1))
      window[:, args.prompt + t] = chosen
    return window[:, args.prompt:]

  def timed(fn):
    start = time.perf_counter()
    out = fn()
    warm = time.perf_counter() - start
    best = float("inf")
    for _ in range(args.repeats):
      start = time.perf_counter()
      fn()
      best = min(best, time.perf_counter() - start)
    return out, warm, best

  kv = config.model.get("num_kv_heads") or heads
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; {args.family} {args.layers} "
        f"layers x {args.embed}, vocab {args.vocab}; {args.batch} prompts of {args.prompt} "
        f"tokens, greedy; best of {args.repeats}")
  print(f"{'new':>5} {'run':<10} {'s':>9} {'tokens/s':>10} {'vs recompute':>13} "
        f"{'first call s':>13} {'cache MiB':>10} {'same tokens':>12}")
  for steps in news:
    prompt_list = prompts.tolist()
    sampling = Sampling(max_new_tokens=steps)
    cached, cached_warm, cached_s = timed(
        lambda p=prompt_list, s=sampling: generator(state, p, s))
    baseline, base_warm, base_s = timed(lambda n=steps: recompute(n))
    # The tokens agree up to each row's first near-tie that the two programs' roundings
    # break apart (a random model's logits are flat; on a GPU, TF32 matmuls).
    same = np.mean([np.argmin(np.append(np.asarray(a) == b, False))
                    for a, b in zip(cached.tokens, baseline, strict=True)]) / steps
    slots = args.prompt + steps
    cache_mib = 2 * args.layers * args.batch * slots * kv * (args.embed // heads) * 4 / 2**20
    made = args.batch * steps
    print(f"{steps:>5} {'recompute':<10} {base_s:>9.4f} {made / base_s:>10.1f} {1.0:>12.2f}x "
          f"{base_warm:>13.2f} {'':>10}")
    print(f"{steps:>5} {'cached':<10} {cached_s:>9.4f} {made / cached_s:>10.1f} "
          f"{base_s / cached_s:>12.2f}x {cached_warm:>13.2f} {cache_mib:>10.2f} "
          f"{same:>11.1%}")


if __name__ == "__main__":
  main()
