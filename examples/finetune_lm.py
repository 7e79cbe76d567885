r"""Fine-tunes a Hugging Face-format language model on a text file, samples from it, exports it.

    python examples/finetune_lm.py --workdir=/tmp/finetune
    python examples/finetune_lm.py --workdir=/tmp/finetune \
        --config.init_from.path=/path/to/hf_model --text=notes.txt

- The model: `--config.init_from.path` names an HF model directory of one of the
  seven families with a mapping (`trainer.interop.families.FAMILIES`); its
  `config.json` sets `config.model`. Without one, a small
  randomly initialised GPT-2 is written in HF format to `<workdir>/base` first.
- The tokenizer: `--tokenizer` (a `tokenizer.json`), else the model directory's
  own `tokenizer.json`, else a byte-level BPE trained here on the text with the
  model's vocabulary size (saved to `<workdir>/tokenizer.json`).
- The text: `--config.data.sources` (a corpus: JSONL or Parquet files), or else
  `--text` files (default: this repository's README and docs, a corpus every clone
  has), whose paragraphs are written as JSONL documents into `<workdir>/data`, 90%
  to train on and every tenth held out. Either way the batches come from the LM
  data pipeline (`trainer.data.lm`: streamed, tokenized, packed into rows of
  `config.seq_len` tokens kept apart by segment ids, the position checkpointed).
- `configs/finetune_lm.py:instruct`: instruction tuning. The example writes prompt and
  response pairs of the text (a paragraph's opening words, and the rest of it) as
  JSONL; each is rendered with the model's chat template (a ChatML template is added to
  a tokenizer trained here) and the loss covers the responses alone.

With `--harness_tasks` (and `--harness_include_path` for tasks of one's own), it
runs lm-evaluation-harness tasks on the training state during training
(`trainer.harness.HarnessEval`), their metrics and a few generations to the writers.

It prints the validation loss before and after training, a few continuations of
held-out text (sampled with a key/value cache, `trainer.generation`), and exports
the result as an HF model
(`<workdir>/hf`: `config.json`, `model.safetensors` with LoRA merged, and the
tokenizer), which `transformers.AutoModelForCausalLM.from_pretrained` loads.
"""

import json
import os
import sys

from absl import app, flags, logging

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lm_setup  # noqa: E402
from lm_setup import (  # noqa: E402, F401  (shared with examples/preference_lm.py)
  CHAT_TOKENS,
  CHATML,
  ROOT,
  documents,
  read_text,
  write_base_model,
)
from lm_setup import load_tokenizer as _load_tokenizer  # noqa: E402

from trainer import config as config_lib  # noqa: E402  (no jax: safe before devices)
from trainer.run import workdir as workdir_lib  # noqa: E402

FLAGS = flags.FLAGS
config_lib.define_config_file(os.path.join(ROOT, "configs", "finetune_lm.py"),
                              "Fine-tuning configuration (configs/finetune_lm.py:<variant>).")
flags.DEFINE_string("workdir", None, "Directory for the base model, checkpoints, metrics and "
                    "the export.")
flags.DEFINE_list("text", None, "Text files (globs) to fine-tune on; default: the README and "
                  "docs/**/*.md of this repository.")
flags.DEFINE_string("tokenizer", None, "A tokenizers tokenizer.json; default: the model's own, "
                    "else one trained on the text.")
flags.DEFINE_integer("samples", 3, "Continuations to sample after training.")
flags.DEFINE_integer("sample_tokens", 24, "Tokens per sampled continuation.")
flags.DEFINE_integer("num_cpu_devices", 8, "Host devices to make on a CPU-only machine.")
lm_setup.define_harness_flags(["The tests make", "A researcher"])
flags.mark_flags_as_required(["workdir"])
flags.register_validator("workdir", workdir_lib.flag_validator)


def load_tokenizer(text: str, vocab_size: int, model_dir: str, workdir: str, chat: bool):
  """`lm_setup.load_tokenizer` with `--tokenizer`."""
  return _load_tokenizer(text, vocab_size, model_dir, workdir, chat, FLAGS.tokenizer)


def write_data(text: str, directory: str, chat: bool) -> tuple[str, str]:
  """The text's paragraphs as JSONL documents (or, with `chat`, prompt and response pairs:
  a paragraph's first 8 words, and the rest), every tenth held out: (train, held-out)."""
  os.makedirs(directory, exist_ok=True)
  paths = [os.path.join(directory, f"{name}.jsonl") for name in ("train", "valid")]
  with open(paths[0], "w") as train, open(paths[1], "w") as valid:
    for i, doc in enumerate(documents(text)):
      words = doc.split()
      if chat and len(words) < 12:
        continue
      record = ({"prompt": "Continue: " + " ".join(words[:8]), "response": " ".join(words[8:])}
                if chat else {"text": doc})
      (valid if i % 10 == 0 else train).write(json.dumps(record) + "\n")
  return paths[0], paths[1]


def sample(trainer, state, tokenizer, prompts, *, tokens: int, seed: int = 0):
  """Continuations of each prompt (token ids), sampled at temperature 0.8: one compiled
  program with a key/value cache, under the layout the model trained in
  (`trainer.generation`)."""
  from trainer.generation import Generator, Sampling
  out = Generator.from_trainer(trainer)(
      state, prompts, Sampling(max_new_tokens=tokens, temperature=0.8), seed=seed)
  return [(tokenizer.decode(prompt), tokenizer.decode(new))
          for prompt, new in zip(prompts, out.tokens, strict=True)]


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  from trainer.distributed import devices
  devices.initialize(FLAGS.num_cpu_devices)
  with devices.naming_the_process():
    finetune(FLAGS.config, FLAGS.workdir)


def finetune(config, workdir: str) -> None:


  from trainer import LanguageModelTrainer, writers
  from trainer.checkpoint import Checkpointer
  from trainer.data import lm
  from trainer.distributed.devices import is_primary

  os.makedirs(workdir, exist_ok=True)
  text = "" if config.data.sources else read_text(FLAGS.text)
  model_dir = lm_setup.start_model(config, workdir)
  tokenizer, tokenizer_path = load_tokenizer(text or "\n", config.model.vocab_size, model_dir,
                                             workdir, config.data.chat)
  if tokenizer.get_vocab_size() > config.model.vocab_size:
    raise app.UsageError(f"the tokenizer {tokenizer_path} has {tokenizer.get_vocab_size()} "
                         f"tokens but the model's vocab_size is {config.model.vocab_size}.")
  with config.unlocked():
    config.data.tokenizer = tokenizer_path
    if not config.data.sources:  # The text's paragraphs as a JSONL corpus.
      train_file, held_file = write_data(text, os.path.join(workdir, "data"),
                                         config.data.chat)
      config.data.sources, config.data.eval_sources = (train_file,), (held_file,)

  trainer = LanguageModelTrainer(config)
  rows = trainer.strategy.process_slice(config.batch_size)
  stream = lm.from_config(config, rows)  # Streamed, tokenized, packed; checkpointed.
  held_out = lm.eval_batches(config)
  if not held_out:
    raise app.UsageError("config.data.eval_sources is empty: the example reports the "
                         "validation loss before and after on held-out data.")
  checkpointer = Checkpointer.from_config(config, workdir)
  writer = writers.create_writer(workdir, config.writers, config)

  try:
    # The loaded model, evaluated, is the state training starts from (one init, not two);
    # a rerun in the same workdir resumes from its latest checkpoint instead.
    fresh = checkpointer.latest_step() is None
    state = trainer.init_state(held_out[0])
    before = trainer.evaluate(state, held_out)["loss"]
    actions = [lm.CorpusMetrics(writer, every_steps=config.log_every_steps)]
    # Benchmark tasks on the training state (trainer.harness), with --harness_tasks.
    actions += lm_setup.harness_actions(trainer, writer, tokenizer_path, config.log_every_steps)
    result = trainer.fit(stream, num_steps=config.num_train_steps, checkpointer=checkpointer,
                         writer=writer, workdir=workdir, state=state if fresh else None,
                         actions=actions)
  finally:
    checkpointer.close()
    writer.close()
  after = trainer.evaluate(result.state, held_out)["loss"]
  first = held_out[0]  # Each row's first document, its first half as a prompt.
  prompts = [row[(segments == 1)][:config.seq_len // 2].tolist()
             for row, segments in zip(first["inputs"], first["segment_ids"], strict=True)]
  samples = sample(trainer, result.state, tokenizer, prompts[:FLAGS.samples],
                   tokens=min(FLAGS.sample_tokens, config.seq_len // 2))
  if not is_primary():
    return
  held_tokens = sum(int((b["segment_ids"] > 0).sum()) for b in held_out)
  lm_setup.report_stop(result, config.num_train_steps, workdir)
  print(f"validation loss: before={before:.4f} after={after:.4f} "
        f"({result.step} steps of {config.batch_size} packed rows of "
        f"{config.seq_len} tokens from {', '.join(config.data.sources)}; {held_tokens} "
        f"held-out tokens)")
  for prompt, continuation in samples:
    print(f"--- ...{prompt[-60:]!r}\n+++ {continuation!r}")
  out = os.path.join(workdir, "hf")
  names = lm_setup.export_with_tokenizer(workdir, out, config, tokenizer_path)
  logging.info("exported %d tensors", len(names))
  print(f"exported to {out} (config.json, model.safetensors, tokenizer.json)")


if __name__ == "__main__":
  config_lib.run(main)
