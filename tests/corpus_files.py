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


#: Chat templates as models publish them: Llama 3's (BOS, header tokens, trimmed content,
#: end of turn) and ChatML's (Qwen2's, with its default system turn).
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] "
    "+ '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}")
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
CHAT_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                 "<|im_start|>", "<|im_end|>"]


def write_chat_tokenizer(directory: pathlib.Path, template: str) -> pathlib.Path:
  """A byte-level BPE `tokenizer.json` (the chat tokens special) and a
  `tokenizer_config.json` with `template`, as a Hugging Face model directory holds them."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  text = [cf_text for cf_text in ("what is the capital of france", "paris is the capital",
                                  "you are a helpful assistant", "user assistant system")]
  tokenizer.train_from_iterator(text * 20, trainers.BpeTrainer(
      vocab_size=300, special_tokens=CHAT_SPECIALS,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
  directory.mkdir(parents=True, exist_ok=True)
  tokenizer.save(str(directory / "tokenizer.json"))
  (directory / "tokenizer_config.json").write_text(json.dumps({
      "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": template,
      "tokenizer_class": "PreTrainedTokenizerFast"}))
  return directory


def write_array_record(path: pathlib.Path, docs: list[tuple[int, int]]) -> pathlib.Path:
  """`docs` as an ArrayRecord file of JSON objects (one record each)."""
  from array_record.python.array_record_module import ArrayRecordWriter

  path.parent.mkdir(parents=True, exist_ok=True)
  writer = ArrayRecordWriter(str(path), "group_size:1")
  for d, n in docs:
    writer.write(json.dumps({"text": document(d, n)}).encode())
  writer.close()
  return path


_TFDS_BUILDER = []


def _tfds_builder():
  """The `corpus_test_text` builder class, defined (and so registered with TFDS) once."""
  if not _TFDS_BUILDER:
    import tensorflow_datasets as tfds

    class CorpusTestText(tfds.core.GeneratorBasedBuilder):
      VERSION = tfds.core.Version("1.0.0")
      docs: list = []

      def _info(self):
        return tfds.core.DatasetInfo(
            builder=self, features=tfds.features.FeaturesDict({"text": tfds.features.Text()}))

      def _split_generators(self, dl_manager):
        del dl_manager
        return {"train": self._generate_examples()}

      def _generate_examples(self):
        for d, n in self.docs:
          yield d, {"text": document(d, n)}

    _TFDS_BUILDER.append(CorpusTestText)
  return _TFDS_BUILDER[0]


def write_tfds_text(data_dir: pathlib.Path, docs: list[tuple[int, int]]) -> str:
  """`docs` as the train split of a TFDS dataset `corpus_test_text` prepared as array_record
  in `data_dir`; returns its source spec."""
  builder = _tfds_builder()
  builder.docs = list(docs)
  builder(data_dir=str(data_dir), file_format="array_record").download_and_prepare()
  return f"tfds:corpus_test_text@{data_dir}:train"
