"""Text files as a stream of token examples: the sources of `trainer.data.lm`.

A source is a list of files (paths or globs) of one format, with the name of the
field that holds each record's text:

- `jsonl`: one JSON object a line (`.jsonl`, `.json`, `.jsonl.gz`, `.json.gz`; gzip
  is read as a stream);
- `parquet`: the string column `field` (`.parquet`), read one row group at a time;
- `array_record`: an ArrayRecord file of JSON objects (`.array_record`), read by index;
- `tfds`: a TFDS text dataset prepared as array_record,
  `tfds:<name>[/<config>][@<data_dir>]:<split>`, its feature `field`, read by index.

Files are read as a stream (one line or one row group in memory at a time), never
whole. Each record's text is tokenized, bracketed by the tokenizer's BOS/EOS where
`Tokenizer` says so, and cut into next-token examples of at most `length` (input,
target) pairs (`pieces`), so every token but a document's first is a target exactly
once per pass, always of the token before it in the same document.

A source is read in `lanes` disjoint shards (record `k` of a file, counted over the
whole file, belongs to shard `k % lanes`), each an independent Grain iterator
(`ShardIterator`) whose state is the epoch, the file, the byte offset (or row) of the
next record and the piece of the current one: restoring it seeks there, whatever
the number of steps behind it. Each epoch visits a shard's files in an order drawn
from `(seed, shard, epoch)`.

A record that cannot be read (a malformed JSON line, a missing or non-text field,
bytes that are not UTF-8, an empty document, a Parquet file without the field) stops
the run naming the file and the line or row (`bad_records="stop"`), or is skipped
and counted by kind (`"skip"`, the counts kept in the iterator's state).

Each format's reader, which hands a shard its next record from a position, is in
`trainer.data.records`.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
import os
from collections.abc import Mapping
from typing import Any

import grain
import numpy as np

from trainer.data.records import (
  ENDINGS,
  FORMATS,  # noqa: F401 (this module's name before the readers moved)
  TFDS_PREFIX,
  BadRecord,
  CorpusError,
  check_tfds,
  format_of,
  has_text_column,
  open_reader,
  tfds_source,  # noqa: F401 (this module's name before the readers moved)
)

#: What a directory source reads (`.json` files only when named: a model directory's
#: `config.json` and `tokenizer.json` are no corpus).
DIRECTORY_ENDINGS = (".jsonl", ".jsonl.gz", ".parquet", ".array_record")
BAD_RECORDS = ("stop", "skip")
#: The kinds of bad record, as counted under `bad_records="skip"`.
BAD_KINDS = ("malformed", "missing_field", "not_utf8", "empty", "schema", "missing_chat",
             "missing_pair", "empty_response", "too_long", "missing_prompt",
             "record_too_long", "missing_completion")


@dataclasses.dataclass(frozen=True)
class TextSource:
  """One source: its files (matched and sorted; each read by its ending's format), the text
  field, its weight."""

  name: str
  files: tuple[str, ...]
  field: str = "text"
  weight: float = 1.0


def resolve(spec: str, *, field: str, weight: float, where: str) -> TextSource:
  """A source from `spec`, a comma-separated list of paths, globs or directories (`~`
  expanded; a directory: its corpus files, recursively), each matching at least one file.

  Raises:
    CorpusError: naming `where` (the config field), a pattern that matches nothing, or a
      file whose ending names no format.
  """
  if not isinstance(spec, str) or not spec.strip():
    raise CorpusError(f"{where}={spec!r} must name files: paths or globs, comma-separated.")
  files = []
  for pattern in (p.strip() for p in spec.split(",") if p.strip()):
    if pattern.startswith(TFDS_PREFIX):
      check_tfds(pattern, where)
      files.append(pattern)
      continue
    pattern = os.path.expanduser(pattern)
    found = sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern) else (
        [pattern] if os.path.isfile(pattern) else [])
    if os.path.isdir(pattern):
      found = sorted(f for f in glob.glob(os.path.join(pattern, "**", "*"), recursive=True)
                     if f.endswith(DIRECTORY_ENDINGS))
    if not found:
      kind = "glob" if glob.has_magic(pattern) else "path"
      raise CorpusError(f"{where}: the {kind} {pattern!r} matches no file.")
    files.extend(found)
  formats = {f: format_of(f) for f in files}
  unknown = [f for f, fmt in formats.items() if fmt is None]
  if unknown:
    raise CorpusError(f"{where}: {unknown[0]!r} is not a corpus file; the endings read are "
                      f"{[e for e, _ in ENDINGS]}.")
  if not isinstance(weight, (int, float)) or not weight > 0:
    raise CorpusError(f"{where}: the weight {weight!r} must be a number > 0.")
  return TextSource(name=spec, files=tuple(files), field=field, weight=float(weight))


class Tokenizer:
  """A `tokenizers` tokenizer and the ids that bracket each document.

  Args:
    path: a `tokenizer.json`, or a Hugging Face model directory holding one (with its
      `tokenizer_config.json` and `generation_config.json`, which say which BOS/EOS it
      adds).
    add_bos, add_eos: None: as the model directory says, as `transformers`'
      `AutoTokenizer` reads it: BOS where `tokenizer_config.json` sets `add_bos_token`,
      else where `tokenizer.json`'s post-processor adds it (Llama 3's does, with no
      `add_bos_token`); EOS at each document's end whenever the tokenizer has one, so a
      packed row's documents end as they did in pretraining. True/False to override.
  """

  def __init__(self, path: str, *, add_bos: bool | None = None, add_eos: bool | None = None):
    from tokenizers import Tokenizer as HFTokenizer

    path = os.path.expanduser(path)
    directory = path if os.path.isdir(path) else os.path.dirname(path)
    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
      raise CorpusError(f"no tokenizer: {file!r} does not exist (give config.data.tokenizer a "
                        f"tokenizer.json, or config.init_from.path a model directory holding "
                        f"one).")
    self.path = file
    self.tokenizer = HFTokenizer.from_file(file)
    settings = _read_json(os.path.join(directory, "tokenizer_config.json"))
    generation = _read_json(os.path.join(directory, "generation_config.json"))
    self.bos_id = self._special(settings.get("bos_token"), generation.get("bos_token_id"))
    self.eos_id = self._special(settings.get("eos_token"), generation.get("eos_token_id"))
    if add_bos is not None:
      want_bos = add_bos
    elif "add_bos_token" in settings:
      want_bos = bool(settings["add_bos_token"])
    else:
      want_bos = self._post_processor_adds_bos()
    want_eos = (self.eos_id is not None) if add_eos is None else add_eos
    for name, want, token in (("BOS", want_bos, self.bos_id), ("EOS", want_eos, self.eos_id)):
      if want and token is None:
        raise CorpusError(f"config.data.add_{name.lower()}=True but the tokenizer {file!r} "
                          f"names no {name} token (tokenizer_config.json / "
                          f"generation_config.json).")
    self.add_bos, self.add_eos = want_bos, want_eos
    self.vocab_size = self.tokenizer.get_vocab_size()
    self.settings, self.settings_path = settings, os.path.join(directory, "tokenizer_config.json")
    self.directory = directory
    self._chat = None

  def _post_processor_adds_bos(self) -> bool:
    """Whether `tokenizer.json`'s post-processor puts BOS before a text (as `tokenizers`'
    `encode(..., add_special_tokens=True)` and `AutoTokenizer` apply it)."""
    if self.bos_id is None:
      return False
    plain = self.tokenizer.encode("a", add_special_tokens=False).ids
    special = self.tokenizer.encode("a", add_special_tokens=True).ids
    return len(special) > len(plain) and special[0] == self.bos_id

  def chat_template(self):
    """The model's chat template (`trainer.data.chat.ChatTemplate`): the directory's
    `chat_template.jinja` (where `transformers` 5's `save_pretrained` writes it), else
    `tokenizer_config.json`'s `chat_template`.

    Raises:
      ChatError: the directory holds neither.
    """
    if self._chat is None:
      from trainer.data.chat import ChatTemplate
      self._chat = ChatTemplate.from_directory(self.directory, self.settings)
    return self._chat

  def encode_text(self, text: str) -> list[int]:
    """A text's ids as `AutoTokenizer` gives them (a prompt's: BOS as the tokenizer adds
    it, no EOS)."""
    ids = self.tokenizer.encode(text, add_special_tokens=False).ids
    return ([self.bos_id] if self.add_bos else []) + ids

  def encode_chat(self, messages) -> tuple[np.ndarray, np.ndarray]:
    """A conversation rendered with the chat template and tokenized as rendered (the template
    writes its own BOS and end-of-turn tokens), and each token's loss weight: 1 for the
    assistant turns' tokens, 0 for the rest."""
    text, spans = self.chat_template().render_with_spans(messages)
    encoding = self.tokenizer.encode(text, add_special_tokens=False)
    weights = [float(any(a <= start < b for a, b in spans)) for start, _ in encoding.offsets]
    return np.asarray(encoding.ids, np.int32), np.asarray(weights, np.float32)

  def _special(self, token, token_id) -> int | None:
    if isinstance(token, dict):  # {"content": "<s>", ...} in older tokenizer configs.
      token = token.get("content")
    if isinstance(token, str) and self.tokenizer.token_to_id(token) is not None:
      return self.tokenizer.token_to_id(token)
    if isinstance(token_id, list):
      token_id = token_id[0] if token_id else None
    return token_id if isinstance(token_id, int) else None

  def __call__(self, text: str) -> np.ndarray:
    """A document's ids: `encode_text`'s, and EOS where the tokenizer adds it."""
    ids = self.encode_text(text) + ([self.eos_id] if self.add_eos else [])
    return np.asarray(ids, np.int32)

  def __getstate__(self):  # Grain's worker processes get the tokenizer by pickling.
    return {**self.__dict__, "tokenizer": self.tokenizer.to_str(), "_chat": None}

  def __setstate__(self, state):
    from tokenizers import Tokenizer as HFTokenizer
    self.__dict__.update(state, tokenizer=HFTokenizer.from_str(state["tokenizer"]))


def _read_json(path: str) -> dict:
  if not os.path.isfile(path):
    return {}
  with open(path, encoding="utf-8") as f:
    return json.load(f)


#: The key of each target token's loss weight, in an instruction record's examples.
WEIGHTS = "loss_weights"


def pieces(ids: np.ndarray, length: int, weights: np.ndarray | None = None
           ) -> list[dict[str, np.ndarray]]:
  """A document's next-token examples: `(inputs, targets)` of at most `length` tokens each,
  `targets[j]` the token after `inputs[j]` (so both have the same length), consecutive
  pieces sharing one token, so each of `ids[1:]` is a target once. With `weights` (one per
  token), each target's weight too (`WEIGHTS`)."""
  out = []
  for s in range(0, len(ids) - 1, length):
    stop = min(s + length, len(ids) - 1)  # The last input is the one before the last token.
    piece = {"inputs": ids[s:stop], "targets": ids[s + 1:stop + 1]}
    if weights is not None:
      piece[WEIGHTS] = weights[s + 1:stop + 1]
    out.append(piece)
  return out


class ShardIterator(grain.DatasetIterator):
  """Shard `shard` of `shards` of a source's records, epoch after epoch (endlessly, or
  `epochs` times), as next-token examples. Its state: `{"epoch", "file", "pos",
  "record", "piece", "skipped"}` (see the module docstring)."""

  def __init__(self, source: TextSource, tokenizer: Tokenizer, *, length: int, shard: int,
               shards: int, seed: int, bad_records: str = "stop", shuffle: bool = True,
               epochs: int | None = None, chat: dict | None = None, encode=None):
    super().__init__()
    self.chat = chat  # Instruction records: `chat.messages_of`'s field names; None: text.
    # Whole records made into examples by `encode(record) -> (bad kind or None, examples)`,
    # whose `describe(kind)` words a bad record (preference pairs,
    # `trainer.preference.data.PairEncoder`); None: text or instruction records.
    self.encode = encode
    self.epochs = epochs  # None: endless; else StopIteration after that many passes.
    self.source, self.tokenizer, self.length = source, tokenizer, length
    self.shard, self.shards, self.seed, self.shuffle = shard, shards, seed, shuffle
    self.bad_records = bad_records
    self.skipped = dict.fromkeys(BAD_KINDS, 0)
    self._epoch, self._file, self._pos, self._record = 0, 0, 0, 0
    self._piece = 0  # Pieces of the current record already handed out.
    self._pending: list = []  # The current record's remaining pieces.
    self._reader = None
    self._empty_epochs = 0

  # -- The order: files per epoch ------------------------------------------------------

  def _files(self, epoch: int) -> list[str]:
    files = list(self.source.files)
    if self.shuffle and len(files) > 1:
      order = np.random.default_rng((self.seed, self.shard, epoch)).permutation(len(files))
      files = [files[i] for i in order]
    return files

  def _open(self):
    path = self._files(self._epoch)[self._file]
    whole = self.chat is not None or self.encode is not None
    field = None if whole else self.source.field  # None: the whole record.
    self._reader = open_reader(path, field, pos=self._pos, record=self._record,
                               chat=self.chat is not None)

  # -- Reading ---------------------------------------------------------------------------

  def __next__(self):
    while not self._pending:
      self._read_record()
    self._piece += 1
    example = self._pending.pop(0)
    if not self._pending:
      self._piece = 0
    return example

  def _read_record(self) -> None:
    """Reads this shard's next record: its pieces into `_pending` (after the `_piece`
    handed out before a restore), or a bad record counted (or raised)."""
    if self.epochs is not None and self._epoch >= self.epochs:
      raise StopIteration
    if self._reader is None:
      self._open()
    item = self._reader.next_for(self.shard, self.shards)
    if item is None:  # The file is done: the next one, or the next epoch.
      self._reader = None
      self._file, self._pos, self._record, self._piece = self._file + 1, 0, 0, 0
      if self._file == len(self.source.files):
        self._epoch, self._file = self._epoch + 1, 0
        self._empty_epochs += 1
        if self._empty_epochs > 1:
          raise CorpusError(f"source {self.source.name!r}: shard {self.shard} of "
                            f"{self.shards} holds no readable record (its files hold fewer "
                            f"records than there are shards, or every record was bad).")
      return
    self._record, self._pos, value = item  # Where this record starts.
    self._reader.advance()
    kind, out = self._examples(value)
    if kind is not None:
      self._piece = 0
      self._bad(kind, self._record, value)
      return
    self._empty_epochs = 0
    self._pending = out[self._piece:]
    if not self._pending:  # Restored past this record's last piece.
      self._piece = 0

  def _examples(self, value) -> tuple[str | None, list]:
    """`(None, examples)` of a record's value, or `(bad kind, [])`."""
    if isinstance(value, BadRecord):
      return value.kind, []
    if self.encode is not None:
      return self.encode(value)
    if self.chat is not None:  # A conversation: the assistant turns' tokens weighed 1.
      from trainer.data.chat import messages_of
      messages = messages_of(value, **self.chat) if isinstance(value, dict) else None
      if messages is None:
        return "missing_chat", []
      ids, weights = self.tokenizer.encode_chat(messages)
      out = [p for p in pieces(ids, self.length, weights) if p[WEIGHTS].any()]
    elif not isinstance(value, str):
      return "missing_field", []
    else:
      out = pieces(self.tokenizer(value), self.length) if value.strip() else []
    return (None, out) if out else ("empty", [])

  def _bad(self, kind: str, record: int, value: Any = None) -> None:
    path = self._files(self._epoch)[self._file]
    unit = {"jsonl": "line", "parquet": "row"}.get(format_of(path), "record")
    what = {"malformed": "is not a JSON object", "missing_field":
            f"has no text field {self.source.field!r}", "not_utf8": "is not UTF-8 text",
            "empty": "is an empty document (fewer than 2 tokens)",
            "schema": f"is in a file without a string column {self.source.field!r}",
            "missing_chat": f"has neither a {self.chat and self.chat['messages_field']!r} "
                            f"list of turns with an assistant turn nor text "
                            f"{self.chat and self.chat['prompt_field']!r} and "
                            f"{self.chat and self.chat['response_field']!r} fields"}.get(kind)
    if what is None:
      what = self.encode.describe(kind, value)
    elif kind in ("missing_field", "missing_chat") and isinstance(value, Mapping):
      what += f" (its fields: {', '.join(map(repr, value)) or 'none'})"
    message = f"{path}: {unit} {record + 1} {what}"
    if self.bad_records == "stop":
      raise CorpusError(f"{message}. config.data.bad_records='stop'; set it to 'skip' to "
                        f"skip such records (they are counted in the logged metrics).")
    if not any(self.skipped.values()):
      logging.warning("%s; skipped (config.data.bad_records='skip') and counted.", message)
    self.skipped[kind] += 1

  # -- Position ----------------------------------------------------------------------------

  def get_state(self):
    if self._pending:  # Inside a record: its start, and how many of its pieces are out.
      pos, record, piece = self._pos, self._record, self._piece
    elif self._reader is not None:
      pos, record, piece = self._reader.pos, self._reader.record, 0
    else:
      pos, record, piece = self._pos, self._record, 0
    return {"epoch": self._epoch, "file": self._file, "pos": int(pos), "record": int(record),
            "piece": int(piece), "skipped": dict(self.skipped)}

  def set_state(self, state):
    self._epoch, self._file = state["epoch"], state["file"]
    self._pos, self._record, self._piece = state["pos"], state["record"], state["piece"]
    self.skipped = {k: int(state.get("skipped", {}).get(k, 0)) for k in BAD_KINDS}
    self._pending, self._reader = [], None


def shard_dataset(source: TextSource, tokenizer: Tokenizer, **kwargs) -> grain.IterDataset:
  """`ShardIterator` as a Grain dataset (what `trainer.data.lm` packs and mixes)."""
  return _ShardDataset(source, tokenizer, kwargs)


class _ShardDataset(grain.IterDataset):
  def __init__(self, source: TextSource, tokenizer: Tokenizer, kwargs: dict):
    super().__init__()
    self._args = (source, tokenizer, kwargs)

  def __iter__(self) -> ShardIterator:
    source, tokenizer, kwargs = self._args
    return ShardIterator(source, tokenizer, **kwargs)


def check_schemas(source: TextSource, bad_records: str) -> None:
  """Reads each Parquet file's schema (its footer) before any compute: under
  `bad_records="stop"` a file without the text column as a string is refused here."""
  if bad_records != "stop":
    return
  import pyarrow.parquet as pq
  for path in (f for f in source.files if format_of(f) == "parquet"):
    schema = pq.read_schema(path)
    if not has_text_column(schema, source.field):
      columns = dict(zip(schema.names, map(str, schema.types), strict=True))
      raise CorpusError(f"{path}: no string column {source.field!r} (its columns: {columns}); "
                        f"every file of a source holds its text field. "
                        f"config.data.bad_records='stop'.")
