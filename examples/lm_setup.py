"""What the language-model examples share: the text they train on by default, a tokenizer,
and a random base model written in Hugging Face format (`finetune_lm.py`,
`preference_lm.py`)."""

import glob
import json
import os

from absl import app

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


def load_tokenizer(text: str, vocab_size: int, model_dir: str, workdir: str, chat: bool,
                   tokenizer_file: str | None = None):
  """`tokenizer_file` (a `tokenizer.json`), else the model directory's own, else a
  byte-level BPE trained on `text` with the model's vocabulary size (saved to
  `<workdir>/tokenizer.json`; with the chat tokens and template when `chat`):
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
      special_tokens=CHAT_TOKENS if chat else [], show_progress=False))
  path = os.path.join(workdir, "tokenizer.json")
  tokenizer.save(path)
  if chat:  # Where trainer.data reads the template and the special tokens.
    with open(os.path.join(workdir, "tokenizer_config.json"), "w") as f:
      json.dump({"eos_token": "<|im_end|>", "chat_template": CHATML}, f, indent=1)
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
