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
import sys

from absl import flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # Run from a checkout without installing.
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
  from trainer.data.train_tokenizer import train_tokenizer

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
  # The command for a corpus of your own: python -m trainer.data.train_tokenizer.
  tokenizer, _ = train_tokenizer(train, FLAGS.out, vocab_size=FLAGS.vocab_size, bos=BOS,
                                 eos=EOS, min_frequency=0)
  print(f"wrote {len(train)} train documents in {FLAGS.shards} shards, {len(held)} held out, "
        f"and a {tokenizer.get_vocab_size()}-token tokenizer to {FLAGS.out}")


if __name__ == "__main__":
  from trainer import config as config_lib
  config_lib.run(main, flags_parser=None)
