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
- The text: `--text` files (default: this repository's README and docs, a corpus
  every clone has), 90% to train on, the last 10% held out. Its paragraphs are the
  documents: the train batches pack them into rows of `config.seq_len` tokens
  (`trainer.data.packing`: each row's documents kept apart by segment ids, each
  counting its positions from 0, the padding out of the loss).

It prints the validation loss before and after training, a few sampled
continuations of held-out text, and exports the result as an HF model
(`<workdir>/hf`: `config.json`, `model.safetensors` with LoRA merged, and the
tokenizer), which `transformers.AutoModelForCausalLM.from_pretrained` loads.
"""

import glob
import os
import sys

from absl import app, flags, logging

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trainer import config as config_lib  # noqa: E402  (no jax: safe before devices)
from trainer.run import workdir as workdir_lib  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
flags.mark_flags_as_required(["workdir"])
flags.register_validator("workdir", workdir_lib.flag_validator)


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


def load_tokenizer(text: str, vocab_size: int, model_dir: str, workdir: str):
  """The tokenizer (see the module docstring), with a byte-level decoder."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  for path in (FLAGS.tokenizer, os.path.join(model_dir, "tokenizer.json")):
    if path and os.path.isfile(path):
      return Tokenizer.from_file(path), path
  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  tokenizer.train_from_iterator(text.splitlines(), trainers.BpeTrainer(
      vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
      show_progress=False))
  path = os.path.join(workdir, "tokenizer.json")
  tokenizer.save(path)
  return tokenizer, path


def write_base_model(config, directory: str) -> None:
  """A randomly initialised model of `config.model` in HF format (what a user would download)."""
  import jax

  from trainer import LanguageModelTrainer
  from trainer.checkpoint.init_from import variables_by_collection
  from trainer.interop import hf
  from trainer.language_model import model_fields

  trainer = LanguageModelTrainer(config)
  init = trainer.steps.init_fn(_batches(config, [0] * (config.seq_len + 1), 0, 1)[0])
  params = jax.jit(lambda rng: init(rng).params)(jax.random.PRNGKey(config.seed))
  values = variables_by_collection(jax.device_get(params), {}, linen=True)["params"]
  hf.export(values, model_fields(**config.model.to_dict()), directory)  # Defaults filled.


def documents(text: str) -> list[str]:
  """The text's paragraphs (split at blank lines), the documents the train batches pack."""
  return [p.strip() for p in text.split("\n\n") if p.strip()]


def _batches(config, ids, start: int, count: int, rows=slice(None)):
  """`count` batches of `config.batch_size` windows of `ids`: batch s draws its windows from
  (seed, s) alone, so a resumed run sees the same batches."""
  import numpy as np

  ids = np.asarray(ids, np.int32)
  out = []
  for step in range(start, start + count):
    rng = np.random.default_rng((config.seed, step))
    starts = rng.integers(0, len(ids) - config.seq_len - 1 + 1, size=config.batch_size)
    windows = np.stack([ids[s:s + config.seq_len + 1] for s in starts])[rows]
    out.append({"inputs": windows[:, :-1], "targets": windows[:, 1:]})
  return out


def held_out_batches(config, ids):
  """Consecutive windows of the held-out ids, in whole batches (at least one)."""
  import numpy as np

  ids = np.asarray(ids, np.int32)
  n = max(1, (len(ids) - 1) // config.seq_len)
  windows = np.stack([ids[i * config.seq_len:i * config.seq_len + config.seq_len + 1]
                      for i in range(n) if (i + 1) * config.seq_len < len(ids)])
  return [{"inputs": windows[i:i + config.eval_batch_size, :-1],
           "targets": windows[i:i + config.eval_batch_size, 1:]}
          for i in range(0, len(windows), config.eval_batch_size)]


def sample(trainer, state, tokenizer, prompts, config, *, tokens: int, seed: int = 0):
  """Continuations of each prompt (token ids), sampled at temperature 0.8."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  canonical = trainer.strategy.to_canonical(state)
  length = config.seq_len

  @jax.jit
  def next_logits(params, model_state, window, position):
    logits, _ = trainer.model_variables.apply(params, model_state, ((window,), {}),
                                              rngs={"dropout": jax.random.PRNGKey(0)},
                                              train=False)
    logits = logits[..., :config.model.vocab_size]  # A vocabulary padded to the mesh: real ids.
    return jnp.take_along_axis(logits, position[:, None, None], axis=1)[:, 0]

  params = jax.tree.map(jnp.asarray, canonical.params)
  model_state = jax.tree.map(jnp.asarray, canonical.model_state)
  rng = np.random.default_rng(seed)
  texts = []
  for prompt in prompts:
    ids = list(prompt[-(length - tokens):])
    start = len(ids)
    for _ in range(tokens):
      window = np.zeros((1, length), np.int32)
      window[0, :len(ids)] = ids[-length:]
      logits = np.asarray(next_logits(params, model_state, window,
                                      np.array([min(len(ids), length) - 1])))[0] / 0.8
      p = np.exp(logits - logits.max())
      ids.append(int(rng.choice(len(p), p=p / p.sum())))
    texts.append((tokenizer.decode(ids[:start]), tokenizer.decode(ids[start:])))
  return texts


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  from trainer.distributed import devices
  devices.initialize(FLAGS.num_cpu_devices)
  with devices.naming_the_process():
    finetune(FLAGS.config, FLAGS.workdir)


def finetune(config, workdir: str) -> None:
  import shutil

  import ml_collections

  from trainer import LanguageModelTrainer, writers
  from trainer.checkpoint import Checkpointer
  from trainer.data import packing
  from trainer.distributed.devices import is_primary
  from trainer.export import export_checkpoint
  from trainer.interop import hf

  os.makedirs(workdir, exist_ok=True)
  text = read_text(FLAGS.text)
  model_dir = config.init_from.path
  if not model_dir:
    model_dir = os.path.join(workdir, "base")
    if not hf.is_hf_checkpoint(model_dir):
      base = ml_collections.ConfigDict(config.to_dict())
      base.lora.update(rank=0, targets=())
      write_base_model(base, model_dir)
      print(f"no --config.init_from.path: wrote a randomly initialised "
            f"{config.model.family} in Hugging Face format to {model_dir}")
  with config.unlocked():
    config.init_from.path = model_dir
    config.model = ml_collections.ConfigDict(hf.model_fields(model_dir))
  tokenizer, tokenizer_path = load_tokenizer(text, config.model.vocab_size, model_dir, workdir)
  if tokenizer.get_vocab_size() > config.model.vocab_size:
    raise app.UsageError(f"the tokenizer {tokenizer_path} has {tokenizer.get_vocab_size()} "
                         f"tokens but the model's vocab_size is {config.model.vocab_size}.")
  docs = [ids for ids in (e.ids for e in tokenizer.encode_batch(documents(text))) if ids]
  split = int(len(docs) * 0.9)
  train_docs = docs[:split]
  held_ids = [i for d in docs[split:] for i in d]
  train_ids = [i for d in train_docs for i in d]
  ids = train_ids + held_ids
  if len(held_ids) <= config.seq_len + 1:
    raise app.UsageError(f"--text holds {len(ids)} tokens: too few to hold out windows of "
                         f"config.seq_len={config.seq_len}.")
  with open(os.path.join(workdir, "config.json"), "w") as f:  # What trainer.export reads.
    f.write(config.to_json())

  trainer = LanguageModelTrainer(config)
  rows = trainer.strategy.process_slice(config.batch_size)
  held_out = held_out_batches(config, held_ids)
  checkpointer = Checkpointer.from_config(config, workdir)
  writer = writers.create_writer(workdir, config.writers, config)

  def stream(start):  # Batch s is the same whichever step a run starts from.
    return packing.packed_batches(train_docs, length=config.seq_len,
                                  batch_size=config.batch_size, seed=config.seed,
                                  start_step=start, rows=rows)

  try:
    # The loaded model, evaluated, is the state training starts from (one init, not two);
    # a rerun in the same workdir resumes from its latest checkpoint instead.
    fresh = checkpointer.latest_step() is None
    state = trainer.init_state(held_out[0])
    before = trainer.evaluate(state, held_out)["loss"]
    result = trainer.fit(stream, num_steps=config.num_train_steps, checkpointer=checkpointer,
                         writer=writer, workdir=workdir, state=state if fresh else None)
  finally:
    checkpointer.close()
    writer.close()
  after = trainer.evaluate(result.state, held_out)["loss"]
  prompts = [held_ids[i:i + config.seq_len // 2]
             for i in range(0, len(held_ids) - config.seq_len, max(1, len(held_ids) // 4))]
  samples = sample(trainer, result.state, tokenizer, prompts[:FLAGS.samples], config,
                   tokens=min(FLAGS.sample_tokens, config.seq_len // 2))
  if not is_primary():
    return
  print(f"validation loss: before={before:.4f} after={after:.4f} "
        f"({len(train_ids)} train tokens in {len(train_docs)} packed documents / "
        f"{len(held_ids)} held-out tokens)")
  for prompt, continuation in samples:
    print(f"--- ...{prompt[-60:]!r}\n+++ {continuation!r}")
  out = os.path.join(workdir, "hf")
  names = export_checkpoint(workdir, out, config=config.to_dict())
  shutil.copy(tokenizer_path, os.path.join(out, "tokenizer.json"))
  logging.info("exported %d tensors", len(names))
  print(f"exported to {out} (config.json, model.safetensors, tokenizer.json)")


if __name__ == "__main__":
  app.run(main, flags_parser=config_lib.parse_flags)
