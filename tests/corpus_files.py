"""Small corpora the corpus tests write: JSONL (plain and gzip), Parquet, and a tokenizer.

Every document is made of words `w<doc>` repeated, and the tokenizer's vocabulary holds
one token per word, so a token id says which document it came from: tests count what
was trained per document by counting ids.
"""

from __future__ import annotations

import gzip
import json
import pathlib

WORDS = 200  # Documents (and word tokens) at most.
BOS, EOS, UNK = "<s>", "</s>", "<unk>"


def word(doc: int) -> str:
  return f"w{doc}"


def document(doc: int, length: int) -> str:
  return " ".join([word(doc)] * length)


def lengths(count: int, seed: int = 0) -> list[int]:
  """Document lengths in words: 1 to 40, some longer than a 16-token row."""
  import numpy as np
  return [int(n) for n in np.random.default_rng(seed).integers(1, 41, size=count)]


def write_tokenizer(directory: pathlib.Path, *, add_bos: bool = True) -> pathlib.Path:
  """A word-level `tokenizer.json` (id of `w<i>` is `i + 3`) and its `tokenizer_config.json`."""
  from tokenizers import Tokenizer, models, pre_tokenizers

  vocab = {UNK: 0, BOS: 1, EOS: 2, **{word(i): i + 3 for i in range(WORDS)}}
  tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
  tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  directory.mkdir(parents=True, exist_ok=True)
  tokenizer.save(str(directory / "tokenizer.json"))
  (directory / "tokenizer_config.json").write_text(json.dumps(
      {"bos_token": BOS, "eos_token": EOS, "add_bos_token": add_bos}))
  return directory


def doc_of(token: int) -> int | None:
  """The document a token id comes from (None for BOS, EOS, padding)."""
  return token - 3 if token >= 3 else None


def write_jsonl(path: pathlib.Path, docs: list[tuple[int, int]], *, field: str = "text",
                lines: list[str] | None = None) -> pathlib.Path:
  """`docs` as `(doc, length)` JSON lines (gzip if the name ends in .gz); `lines` appended
  raw (bad records)."""
  body = "".join(json.dumps({field: document(d, n)}) + "\n" for d, n in docs)
  body += "".join(line + "\n" for line in lines or [])
  path.parent.mkdir(parents=True, exist_ok=True)
  if path.suffix == ".gz":
    with gzip.open(path, "wt", encoding="utf-8") as f:
      f.write(body)
  else:
    path.write_text(body, encoding="utf-8")
  return path


def write_parquet(path: pathlib.Path, docs: list[tuple[int, int]], *, column: str = "text",
                  row_group_size: int = 7) -> pathlib.Path:
  import pyarrow as pa
  import pyarrow.parquet as pq

  path.parent.mkdir(parents=True, exist_ok=True)
  pq.write_table(pa.table({column: [document(d, n) for d, n in docs]}), path,
                 row_group_size=row_group_size)
  return path


def write_corpus(root: pathlib.Path, docs: int = 60) -> dict[str, pathlib.Path]:
  """Documents 0..docs-1 split over two JSONL files (one gzipped) and a Parquet file, with
  the tokenizer in `root`."""
  sizes = list(enumerate(lengths(docs)))
  third = docs // 3
  return {"tokenizer": write_tokenizer(root),
          "a": write_jsonl(root / "corpus" / "a.jsonl", sizes[:third]),
          "b": write_jsonl(root / "corpus" / "b.jsonl.gz", sizes[third:2 * third]),
          "c": write_parquet(root / "corpus" / "c.parquet", sizes[2 * third:])}
