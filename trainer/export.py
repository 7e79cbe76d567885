r"""Writes a run's model as a Hugging Face checkpoint: `config.json` + `model.safetensors`.

    python -m trainer.export --workdir=/tmp/finetune --out=/tmp/finetune_hf \
        [--step=N] [--member=i] [--config=RUN_CONFIG.json] [--dtype=bfloat16] [--adapters]

The checkpoint may come from any strategy (an ensemble's or a sweep's: pick the
member with `--member`); the model must be of a family with a mapping
(`config.model.family`: one of `trainer.interop.families.FAMILIES`, `gpt2`, `llama`,
`mistral`, `qwen2`, `qwen3`, `mixtral`, `qwen3_moe`). The model's fields come from the run's
config: `--config` (a JSON config, as every run with a workdir writes to
`<workdir>/config.json`, or a sweep's `sweep_best_config.json`), by default
`<workdir>/config.json`. LoRA adapters (`config.lora`) are merged into their
weights first. The run's tokenizer (`config.data.tokenizer`, else the model directory it
started from) is copied beside the weights with its chat template, and
`generation_config.json` names its EOS. `transformers`'
`AutoModelForCausalLM.from_pretrained(out)` and `AutoTokenizer.from_pretrained(out)` load
the result. `--adapters` writes the LoRA adapters alone in PEFT's format instead
(`trainer.interop.peft`), which `peft.PeftModel.from_pretrained` loads onto the base.
"""

from __future__ import annotations

import json
import os
from typing import Any

from absl import app, flags

FLAGS = flags.FLAGS


def _define_flags() -> None:
  """The command line's flags (defined when run as a program, so importing this module
  defines none)."""
  flags.DEFINE_string("workdir", None, "The run's workdir (holding checkpoints/).")
  flags.DEFINE_string("out", None, "The directory to write config.json and model.safetensors "
                      "to.")
  flags.DEFINE_integer("step", -1, "The checkpoint step (-1: the latest).")
  flags.DEFINE_integer("member", -1, "An ensemble checkpoint's member to export.")
  flags.DEFINE_string("config", None, "The run's config as JSON (default: "
                      "<workdir>/config.json).")
  flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16", "float16"],
                    "The dtype of the written tensors.")
  flags.DEFINE_bool("adapters", False, "Write the LoRA adapters alone in PEFT's format "
                    "(adapter_config.json + adapter_model.safetensors) instead of the "
                    "merged model.")

def run_config(workdir: str, config_path: str | None) -> dict[str, Any]:
  """The run's config as a dict, from `config_path` or `<workdir>/config.json`."""
  path = config_path or os.path.join(workdir, "config.json")
  if not os.path.isfile(path):
    raise ValueError(f"--config={path!r} does not exist: the export needs the run's "
                     f"config.model (a run with a workdir writes <workdir>/config.json; one that "
                     f"ran without, or whose file is gone: pass --config=its config as JSON).")
  with open(path) as f:
    return json.load(f)


def export_checkpoint(workdir: str, out: str, *, step: int = -1, member: int = -1,
                      config: dict[str, Any], dtype: str = "float32",
                      tokenizer: str | None = None, adapters: bool = False) -> list[str]:
  """Exports checkpoint `step` of `workdir` (member `member` of an ensemble) to `out`, with
  the tokenizer (`tokenizer`, else the run's, where its files still exist:
  `write_tokenizer`); returns the HF tensor names written. `adapters`: the LoRA adapters
  alone, in PEFT's format (`trainer.interop.peft`), instead of the merged model.

  Raises:
    ValueError: no checkpoint, an ensemble without `member`, a model of no mapped family,
      or parameters the family's mapping cannot write.
  """
  import numpy as np

  from trainer.checkpoint import init_from
  from trainer.interop import families, hf
  from trainer.step import lora, quantized_base

  model = dict(config["model"])
  family = families.get(model.get("family", "transformer"), field="config.model.family")
  source = init_from.open_source(workdir, step=step, linen=family.model_type == "gpt2")
  if source.num_members and not 0 <= member < source.num_members:
    raise ValueError(f"--member={member}: {source.description} holds an ensemble of "
                     f"{source.num_members}; pass --member between 0 and "
                     f"{source.num_members - 1} (a sweep's best: its report names it).")
  if not source.num_members and member >= 0:
    raise ValueError(f"--member={member}: {source.description} holds one model; leave "
                     f"--member out.")
  paths = sorted(source.arrays["params"])
  values = source.read({"params": paths})["params"]
  if source.num_members:
    values = {p: np.asarray(x[member]) for p, x in values.items()}
  spec = dict(config["lora"]) if "lora" in config else {}
  if spec.get("base_dtype") in quantized_base.QTYPES:  # The dequantized base, then adapters.
    values = quantized_base.dequantized_values(values, spec["base_dtype"])
  if adapters:  # The adapters alone, for PEFT onto the base the run started from.
    from trainer.interop import peft
    return peft.export_adapters(values, model, spec, out, dtype=dtype,
                                base=config["init_from"]["path"] or None)
  values = lora.merged(values, spec)
  names = hf.export(values, model, out, dtype=dtype)
  tokenizer = tokenizer or _run_tokenizer(config)
  if tokenizer:
    write_tokenizer(tokenizer, out)
  return names


#: A tokenizer's files that go with an exported model, as `save_pretrained` writes them.
TOKENIZER_FILES = ("tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def _run_tokenizer(config: dict[str, Any]) -> str | None:
  """The run's tokenizer (`config.data.tokenizer`, else `config.init_from.path`), where it
  still holds a `tokenizer.json`; None otherwise."""
  for section, field in (("data", "tokenizer"), ("init_from", "path")):
    path = config[section][field] if field in config[section] else None
    if path and os.path.isfile(os.path.join(path, "tokenizer.json") if os.path.isdir(path)
                               else path):
      return path
  return None


def write_tokenizer(tokenizer: str, out: str) -> list[str]:
  """Copies a tokenizer (a `tokenizer.json`, or the directory holding it) into `out`, with
  the files beside it (`TOKENIZER_FILES`), and writes `generation_config.json`: the source
  directory's, else one naming the tokenizer's BOS and EOS, so that `transformers`'
  `generate` stops where this project's does. Returns the files written."""
  import shutil

  from trainer.data.corpus import Tokenizer
  tok = Tokenizer(tokenizer)
  os.makedirs(out, exist_ok=True)
  written = []
  for name, source in [("tokenizer.json", tok.path), *(
      (name, os.path.join(tok.directory, name)) for name in TOKENIZER_FILES)]:
    target = os.path.join(out, name)
    if os.path.isfile(source) and os.path.abspath(source) != os.path.abspath(target):
      shutil.copyfile(source, target)
      written.append(name)
  generation = {}
  source = os.path.join(tok.directory, "generation_config.json")
  if os.path.isfile(source):
    with open(source) as f:
      generation = json.load(f)
  for key, value in (("bos_token_id", tok.bos_id), ("eos_token_id", tok.eos_id)):
    if generation.get(key) is None and value is not None:
      generation[key] = value
  with open(os.path.join(out, "generation_config.json"), "w") as f:
    json.dump(generation, f, indent=2)
  return [*written, "generation_config.json"]


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  if not FLAGS.workdir or not FLAGS.out:
    raise app.UsageError("--workdir and --out are required.")
  from trainer.distributed import devices
  devices.initialize(1)
  names = export_checkpoint(FLAGS.workdir, FLAGS.out, step=FLAGS.step, member=FLAGS.member,
                            config=run_config(FLAGS.workdir, FLAGS.config),
                            dtype=FLAGS.dtype, adapters=FLAGS.adapters)
  if FLAGS.adapters:
    from trainer.interop import peft
    print(f"wrote {len(names)} tensors to {os.path.join(FLAGS.out, peft.WEIGHTS)} "
          f"and {os.path.join(FLAGS.out, peft.CONFIG)}")
    return
  print(f"wrote {len(names)} tensors to {os.path.join(FLAGS.out, 'model.safetensors')} "
        f"and {os.path.join(FLAGS.out, 'config.json')}, and the tokenizer's files")


if __name__ == "__main__":
  _define_flags()
  from trainer import config as config_lib
  config_lib.run(main, flags_parser=None)
