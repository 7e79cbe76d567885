"""What the language-model examples share: the text they train on by default, a tokenizer,
and a random base model written in Hugging Face format (`finetune_lm.py`,
`preference_lm.py`)."""

import glob
import json
import os

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read_text(patterns) -> str:
  """The text of every file the patterns match, in order, joined by blank lines."""
  if not patterns:
    patterns = [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "docs", "**", "*.md")]
  files = [f for p in patterns for f in sorted(glob.glob(p, recursive=True))]
  if not files:
    raise app.UsageError(f"--text={patterns} matches no file.")
  texts = []
  for path in files:
    with open(path, encoding="utf-8") as f:
      texts.append(f.read())
  return "\n\n".join(texts)


#: A ChatML template (Qwen2's form), added to a tokenizer trained here for instruction data.
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
          "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt "
          "%}{{ '<|im_start|>assistant\\n' }}{% endif %}")
CHAT_TOKENS = ["<|im_start|>", "<|im_end|>"]


#: The end of a document, as GPT-2's tokenizer names it: a tokenizer trained here has it,
#: so documents end with it in training and generations stop at it.
EOS = "<|endoftext|>"


def load_tokenizer(text: str, vocab_size: int, model_dir: str, workdir: str, chat: bool,
                   tokenizer_file: str | None = None):
  """`tokenizer_file` (a `tokenizer.json`), else the model directory's own, else a
  byte-level BPE trained on `text` with the model's vocabulary size (saved to
  `<workdir>/tokenizer.json`, with a `tokenizer_config.json` naming its EOS, `EOS`; with
  the chat tokens and template, and `<|im_end|>` as EOS, when `chat`):
  `(tokenizer, its path)`."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  for path in (tokenizer_file, os.path.join(model_dir, "tokenizer.json")):
    if path and os.path.isfile(path):
      return Tokenizer.from_file(path), path
  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  tokenizer.train_from_iterator(text.splitlines(), trainers.BpeTrainer(
      vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
      special_tokens=[EOS, *(CHAT_TOKENS if chat else [])], show_progress=False))
  path = os.path.join(workdir, "tokenizer.json")
  tokenizer.save(path)
  settings = {"eos_token": "<|im_end|>", "chat_template": CHATML} if chat else {
      "eos_token": EOS}
  with open(os.path.join(workdir, "tokenizer_config.json"), "w") as f:  # trainer.data reads it.
    json.dump(settings, f, indent=1)
  return tokenizer, path


def write_base_model(config, directory: str) -> None:
  """A randomly initialised model of `config.model` in HF format (what a user would download)."""
  import jax
  import numpy as np

  from trainer import LanguageModelTrainer
  from trainer.checkpoint.init_from import variables_by_collection
  from trainer.interop import hf
  from trainer.language_model import model_fields

  trainer = LanguageModelTrainer(config)
  tokens = np.zeros((config.batch_size, config.seq_len), np.int32)  # Shapes for init.
  init = trainer.steps.init_fn({"inputs": tokens, "targets": tokens})
  params = jax.jit(lambda rng: init(rng).params)(jax.random.PRNGKey(config.seed))
  values = variables_by_collection(jax.device_get(params), {}, linen=True)["params"]
  hf.export(values, model_fields(**config.model.to_dict()), directory)  # Defaults filled.


def documents(text: str) -> list[str]:
  """The text's paragraphs (split at blank lines), the documents the train batches pack."""
  return [p.strip() for p in text.split("\n\n") if p.strip()]


def define_harness_flags(prompts: list[str]) -> None:
  """The `--harness_*` flags: lm-evaluation-harness tasks run during training."""
  flags.DEFINE_list("harness_tasks", [], "lm-evaluation-harness tasks to run during training "
                    "(every --config.log_every_steps and at the end; trainer.harness).")
  flags.DEFINE_string("harness_include_path", None, "A directory of harness task YAMLs.")
  flags.DEFINE_boolean("harness_builtin_tasks", True, "Also index the harness's built-in "
                       "tasks.")
  flags.DEFINE_list("harness_prompts", prompts, "Prompts whose continuations go to the "
                    "writers as text with the harness's results.")


def harness_actions(trainer, writer, tokenizer_path: str, every_steps: int,
                    max_new_tokens: int = 16) -> list:
  """`[trainer.harness.HarnessEval]` of the `--harness_*` flags ([] without tasks): the
  tasks scored on the training state, in its layout, with a few generations (of at most
  `max_new_tokens`)."""
  values = flags.FLAGS
  if not values.harness_tasks:
    return []
  from trainer.harness import HarnessEval
  return [HarnessEval(trainer, writer, values.harness_tasks, every_steps=every_steps,
                      tokenizer=tokenizer_path, include_path=values.harness_include_path,
                      builtin_tasks=values.harness_builtin_tasks,
                      prompts=values.harness_prompts, max_new_tokens=max_new_tokens)]


def report_stop(result, num_steps: int, workdir: str) -> None:
  """Prints that a run stopped before its end (Ctrl-C, SIGTERM, early stopping), where,
  and how it resumes; nothing for a run that finished (`<workdir>/status.json` says the
  same for a script: `trainer.loop.status`)."""
  from trainer.sweep import FINISHED
  if result.stopped_by in (None, FINISHED) or result.step >= num_steps:
    return
  print(f"stopped at step {result.step} of {num_steps} ({result.stopped_by}); the figures "
        f"below are step {result.step}'s, and the same command resumes the run from "
        f"{workdir}")


def sweep_ties(workdir: str) -> str:
  """` (tied with <labels>: the first is kept)` where the sweep's best members tied on its
  metric (`sweep.json`'s best `tied_with`), else ''."""
  with open(os.path.join(workdir, "sweep.json")) as f:
    tied = (json.load(f).get("best") or {}).get("tied_with")
  return f" (tied with {'; '.join(tied)}: the first is kept)" if tied else ""


def export_with_tokenizer(source: str, out: str, config, tokenizer_path: str) -> list[str]:
  """Exports the latest checkpoint of `source` (a workdir, or a sweep's `sweep_best`) as an
  HF model in `out`, with the tokenizer's files (its chat template and special tokens go
  with the model, and `generation_config.json` names its EOS); returns the tensor names
  written."""
  from trainer.export import export_checkpoint
  return export_checkpoint(source, out, config=config.to_dict(), tokenizer=tokenizer_path)


def start_model(config, workdir: str, section: str | None = None) -> str:
  """`config.init_from.path`, or else a random base model of `config.model` written in HF
  format to `<workdir>/base` (once); `config.model` and `init_from.path` set from it.
  `section` is the post-training config's own (dropped for the plain LM that writes it)."""
  import ml_collections

  from configs import base as base_config
  from trainer.interop import hf

  model_dir = config.init_from.path
  if not model_dir:
    model_dir = os.path.join(workdir, "base")
    if not hf.is_hf_checkpoint(model_dir):
      base = ml_collections.ConfigDict(config.to_dict())
      base.lora.update(rank=0, targets=(), base_dtype="")
      if section is not None:
        del base[section]
      base.sweep = base_config.get_config().sweep  # One base model, whatever is swept.
      base.trainer = "trainer.language_model:LanguageModelTrainer"
      write_base_model(base, model_dir)
      print(f"no --config.init_from.path: wrote a randomly initialised "
            f"{config.model.family} in Hugging Face format to {model_dir}")
  with config.unlocked():
    config.init_from.path = model_dir
    config.model = ml_collections.ConfigDict(hf.model_fields(model_dir))
  return model_dir
