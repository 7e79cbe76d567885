r"""Writes a small text corpus and its tokenizer, offline: what `transformer_lm.py` trains on.

    python examples/write_corpus.py --out=/tmp/corpus

The documents are the paragraphs of this repository's README and docs (a corpus
every clone has), written as gzipped JSONL shards (`train-0000N.jsonl.gz`, one
`{"text": ...}` object a line, as the Hugging Face hub publishes corpora) and one
held-out shard (`valid.jsonl`), with a byte-level BPE `tokenizer.json` trained on
the train shards and a `tokenizer_config.json` naming its BOS and EOS tokens. Then:

    python examples/transformer_lm.py --workdir=/tmp/lm_corpus \
        --config.data.sources='("/tmp/corpus/train-*.jsonl.gz",)' \
        --config.data.eval_sources='("/tmp/corpus/valid.jsonl",)' \
        --config.data.tokenizer=/tmp/corpus --config.model.vocab_size=512
"""

import glob
import gzip
import json
import os

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "Directory to write the corpus and tokenizer into.")
flags.DEFINE_integer("shards", 4, "Train shards.")
flags.DEFINE_integer("vocab_size", 512, "The tokenizer's vocabulary (BOS and EOS included).")
flags.mark_flags_as_required(["out"])

BOS, EOS = "<|bos|>", "<|eos|>"


def paragraphs() -> list[str]:
  files = [os.path.join(ROOT, "README.md"),
           *sorted(glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))]
  out = []
  for path in files:
    with open(path, encoding="utf-8") as f:
      out.extend(p.strip() for p in f.read().split("\n\n") if p.strip())
  return out


def main(argv):
  del argv
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  os.makedirs(FLAGS.out, exist_ok=True)
  docs = paragraphs()
  held = docs[::10]  # Every tenth paragraph held out.
  train = [d for i, d in enumerate(docs) if i % 10]
  for shard in range(FLAGS.shards):
    with gzip.open(os.path.join(FLAGS.out, f"train-{shard:05d}.jsonl.gz"), "wt",
                   encoding="utf-8") as f:
      for doc in train[shard::FLAGS.shards]:
        f.write(json.dumps({"text": doc}) + "\n")
  with open(os.path.join(FLAGS.out, "valid.jsonl"), "w", encoding="utf-8") as f:
    for doc in held:
      f.write(json.dumps({"text": doc}) + "\n")
  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  tokenizer.train_from_iterator(train, trainers.BpeTrainer(
      vocab_size=FLAGS.vocab_size, special_tokens=[BOS, EOS],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
  tokenizer.save(os.path.join(FLAGS.out, "tokenizer.json"))
  with open(os.path.join(FLAGS.out, "tokenizer_config.json"), "w") as f:
    json.dump({"bos_token": BOS, "eos_token": EOS, "add_bos_token": True}, f, indent=1)
  print(f"wrote {len(train)} train documents in {FLAGS.shards} shards, {len(held)} held out, "
        f"and a {tokenizer.get_vocab_size()}-token tokenizer to {FLAGS.out}")


if __name__ == "__main__":
  app.run(main)
