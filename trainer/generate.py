r"""Prints continuations of prompts from a trained run or a Hugging Face model directory.

    python -m trainer.generate --workdir=/tmp/finetune --prompt="Once upon a time" \
        [--prompt=...] [--prompts_file=prompts.txt] [--max_new_tokens=32] \
        [--temperature=0.8 --top_k=50 --top_p=0.95 --seed=0] [--step=N] [--member=i]

    python -m trainer.generate --init_from=/path/to/hf_model --prompt="..."

The model, its layout and its tokenizer come from the run's config (`--config`, by
default `<workdir>/config.json`, which every run with a workdir writes): the
checkpoint's parameters are restored under the run's strategy (`--strategy` picks
another, e.g. `single_device` for a run trained as an ensemble, whose member
`--member` names), and the prompts tokenized with `config.data.tokenizer` (or
`--tokenizer`). With `--init_from` the model is the directory's (`config.json` and
safetensors of a family `trainer.interop.families` maps) on one device, its tokenizer
the directory's own. Generation stops at the tokenizer's EOS id (`--stop_ids` adds
others; `--stop_ids=none` none). `--token_ids` takes the prompts as comma-separated
ids and prints ids (no tokenizer needed).

All prompts run as one batch in one compiled program (`trainer.generation`).
"""

from __future__ import annotations

import dataclasses
import json

from absl import app, flags

FLAGS = flags.FLAGS


def define_model_flags(doing: str) -> None:
  """The flags that name a model and its layout: a run (`--workdir`, `--config`, `--step`,
  `--member`, `--strategy`) or a Hugging Face directory (`--init_from`), its tokenizer and
  the host devices (`trainer.harness`'s command takes the same)."""
  flags.DEFINE_string("workdir", None, "A run's workdir (its checkpoints/ and config.json).")
  flags.DEFINE_string("init_from", None, "A Hugging Face model directory, instead of a run.")
  flags.DEFINE_string("config", None, "The run's config as JSON (default: "
                      "<workdir>/config.json).")
  flags.DEFINE_integer("step", -1, "The checkpoint step (-1: the latest).")
  flags.DEFINE_integer("member", -1, "An ensemble checkpoint's member.")
  flags.DEFINE_string("strategy", None, f"{doing} under this strategy instead of the run's "
                      f"(e.g. single_device).")
  flags.DEFINE_string("tokenizer", None, "A tokenizer.json or model directory (default: the "
                      "run's config.data.tokenizer, or --init_from's).")
  flags.DEFINE_integer("num_cpu_devices", 1, "Host CPU devices to create (a layout trained "
                       "on several fake CPU devices needs them).")


def _define_flags() -> None:
  define_model_flags("Generate")
  flags.DEFINE_multi_string("prompt", [], "A prompt (repeatable).")
  flags.DEFINE_string("prompts_file", None, "A file of prompts, one per line.")
  flags.DEFINE_boolean("token_ids", False, "Prompts are comma-separated token ids; print ids.")
  flags.DEFINE_integer("max_new_tokens", 32, "The most new tokens per prompt.")
  flags.DEFINE_float("temperature", 0.0, "0: greedy; else the sampling temperature.")
  flags.DEFINE_integer("top_k", 0, "Sample among the k most likely tokens (0: all).")
  flags.DEFINE_float("top_p", 1.0, "Nucleus sampling's probability mass, in (0, 1].")
  flags.DEFINE_integer("seed", 0, "The sampling seed.")
  flags.DEFINE_string("stop_ids", "", "Comma-separated ids that end a continuation besides "
                      "the tokenizer's EOS; 'none': not even EOS.")


class GenerateError(ValueError):
  """A request the command cannot serve, named before anything is compiled."""


def run_config(workdir: str | None, init_from: str | None, config_path: str | None):
  """The config the model is built from: the run's, or a one-device config of `init_from`'s
  model."""
  import ml_collections

  from trainer.interop import hf
  if bool(workdir) == bool(init_from):
    raise GenerateError("give exactly one of --workdir (a run) and --init_from (a Hugging "
                        "Face model directory).")
  if init_from:
    if not hf.is_hf_checkpoint(init_from):
      raise GenerateError(f"--init_from={init_from!r} is not a Hugging Face model directory "
                          f"(config.json and *.safetensors).")
    from configs import lm
    config = lm.get_config("data_parallel")
    config.strategy.name = "single_device"
    config.model = ml_collections.ConfigDict(hf.model_fields(init_from))
    config.init_from.path = init_from
    config.batch_size = config.eval_batch_size = 1
    return config
  from configs import lm
  from trainer.export import run_config as read_json
  try:
    values = read_json(workdir, config_path)
  except ValueError as e:
    raise GenerateError(str(e).replace("the export", "generation")) from None
  # Over today's defaults: a run written before a field existed reads it at its default.
  # The model is the file's alone: a field it leaves out is its family's default, not the
  # example LM's.
  merged = _merged(lm.get_config().to_dict(), values)
  if "model" in values:
    merged["model"] = values["model"]
  config = ml_collections.ConfigDict(merged)
  config.init_from.update(path=workdir, rules=(), fresh=())
  # The run's train and held-out files are not read here: they may be gone.
  config.data.update(sources=(), weights=(), text_fields=(), eval_sources=(),
                     eval_text_fields=())
  return config


def _merged(defaults: dict, values: dict) -> dict:
  """`values` over `defaults`, section by section (a key only `values` has is kept)."""
  out = dict(defaults)
  for key, value in values.items():
    inner = out.get(key)
    out[key] = (_merged(inner, value) if isinstance(inner, dict) and isinstance(value, dict)
                else value)
  return out


def build_trainer(config, *, step: int = -1, member: int = -1, strategy: str | None = None):
  """The config's `LanguageModelTrainer`, its `init_from` the checkpoint `step` (and
  `member`), under `strategy` if given; nothing is read yet (`restored_state`)."""
  from trainer.language_model import LanguageModelTrainer
  config.init_from.update(step=step, member=member)
  if strategy:
    config.strategy.name = strategy
  return LanguageModelTrainer(config)


def restored_state(trainer):
  """The trainer's state with its `config.init_from` parameters, placed by its strategy."""
  import numpy as np
  config = trainer.config
  rows = max(config.batch_size, trainer.strategy.batch_multiple)
  tokens = np.zeros((rows, config.seq_len), np.int32)
  return trainer.init_state({"inputs": tokens, "targets": tokens})


def read_prompts(prompts: list[str], prompts_file: str | None) -> list[str]:
  out = list(prompts)
  if prompts_file:
    with open(prompts_file) as f:
      out += [line.rstrip("\n") for line in f if line.strip()]
  if not out:
    raise GenerateError("no prompts: pass --prompt (repeatable) or --prompts_file.")
  return out


def generate(config, prompts: list[str], *, step: int = -1, member: int = -1,
             strategy: str | None = None, tokenizer: str | None = None,
             token_ids: bool = False, sampling=None, seed: int = 0, stop_ids: str = ""):
  """`(prompts as the model saw them, continuations)`, texts or id lists (`token_ids`)."""
  from trainer.data.corpus import Tokenizer
  from trainer.generation import Generator, Sampling

  sampling = sampling or Sampling()
  decode = None
  stops: tuple[int, ...] = ()
  if token_ids:
    try:
      ids = [[int(t) for t in p.replace(" ", "").split(",") if t] for p in prompts]
    except ValueError:
      raise GenerateError(f"--token_ids: prompts must be comma-separated integers; got "
                          f"{prompts!r}.") from None
  else:
    path = tokenizer or config.data.tokenizer or config.init_from.path
    try:
      tok = Tokenizer(path, add_eos=False)
    except ValueError as e:
      raise GenerateError(f"{e} Pass --tokenizer=<a tokenizer.json or a model directory> "
                          f"(an export of the run holds its tokenizer).") from None
    ids = [tok(p).tolist() for p in prompts]
    decode = tok.tokenizer.decode
    stops = () if tok.eos_id is None else (tok.eos_id,)
  if stop_ids == "none":
    stops = ()
  elif stop_ids:
    stops += tuple(int(t) for t in stop_ids.split(","))
  sampling = dataclasses.replace(sampling, stop_tokens=tuple(dict.fromkeys(stops)))
  trainer = build_trainer(config, step=step, member=member, strategy=strategy)
  generator = Generator.from_trainer(trainer)
  generator.check(ids, sampling)  # Before the checkpoint is read.
  out = generator(restored_state(trainer), ids, sampling, seed=seed)
  if decode is None:
    return ids, out.tokens
  return ([decode(p, skip_special_tokens=False) for p in ids],
          [decode(t, skip_special_tokens=True) for t in out.tokens])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  from trainer.distributed import devices
  from trainer.generation import Sampling
  devices.initialize(FLAGS.num_cpu_devices)
  config = run_config(FLAGS.workdir, FLAGS.init_from, FLAGS.config)
  prompts = read_prompts(FLAGS.prompt, FLAGS.prompts_file)
  sampling = Sampling(max_new_tokens=FLAGS.max_new_tokens, temperature=FLAGS.temperature,
                      top_k=FLAGS.top_k, top_p=FLAGS.top_p)
  shown, continuations = generate(
      config, prompts, step=FLAGS.step, member=FLAGS.member, strategy=FLAGS.strategy,
      tokenizer=FLAGS.tokenizer, token_ids=FLAGS.token_ids, sampling=sampling,
      seed=FLAGS.seed, stop_ids=FLAGS.stop_ids)
  if devices.is_primary():
    for i, (prompt, continuation) in enumerate(zip(shown, continuations, strict=True)):
      print(f"[{i}] {json.dumps(prompt) if FLAGS.token_ids else prompt!r}")
      print(f"  -> {json.dumps(continuation) if FLAGS.token_ids else continuation!r}")


if __name__ == "__main__":
  _define_flags()
  from trainer import config as config_lib
  config_lib.run(main, flags_parser=None)
