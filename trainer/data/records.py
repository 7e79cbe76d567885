"""The records of each corpus file format, read from a position (`trainer.data.corpus`'s
readers).

A reader opens one file at a record (and, for JSONL, at its byte offset) and hands a
shard its next record as `(record, position, text)`, where the text is a `BadRecord`
(its kind) when the record cannot be read; `advance` moves past it. JSONL is read as a
stream, one line at a time; Parquet one row group at a time; ArrayRecord files and
prepared TFDS splits by index, so a shard's next record is found by arithmetic.
"""

from __future__ import annotations

import dataclasses
import gzip
import json

import grain
import numpy as np

#: Formats by file ending, longest first.
ENDINGS = ((".jsonl.gz", "jsonl"), (".json.gz", "jsonl"), (".jsonl", "jsonl"),
           (".json", "jsonl"), (".parquet", "parquet"), (".array_record", "array_record"))
FORMATS = ("jsonl", "parquet", "array_record", "tfds")
#: A TFDS text dataset as a source: `tfds:<name>[/<config>][@<data_dir>]:<split>`, prepared as
#: array_record (random access, no TensorFlow at read time).
TFDS_PREFIX = "tfds:"


class CorpusError(ValueError):
  """A source that cannot be read, or a bad record under `bad_records="stop"`."""


def format_of(path: str) -> str | None:
  """The format a corpus file is read in (`ENDINGS`; `tfds` for a `TFDS_PREFIX` source),
  None for any other file."""
  if path.startswith(TFDS_PREFIX):
    return "tfds"
  for ending, fmt in ENDINGS:
    if path.endswith(ending):
      return fmt
  return None


@dataclasses.dataclass(frozen=True)
class BadRecord:
  kind: str


class JsonLines:
  """A JSONL file (gzip too) from byte offset `pos`, line `record`; `next_for` returns the
  next line of a shard as `(line, offset, text or BadRecord)` without moving past it."""

  def __init__(self, path: str, field: str | None, pos: int, record: int):
    self.path, self.field = path, field
    self._file = gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")
    self._file.seek(pos)
    self.pos, self.record = pos, record
    self._line = None

  def next_for(self, shard: int, shards: int):
    while True:
      if self._line is None:
        self._line = self._file.readline()
      if not self._line:
        self._file.close()
        return None
      if self.record % shards == shard and self._line.strip():
        return self.record, self.pos, self._parse(self._line, self.field)
      self.advance()

  def advance(self) -> None:
    self.pos += len(self._line)
    self.record += 1
    self._line = None

  @staticmethod
  def _parse(line: bytes, field: str | None):
    try:
      text = line.decode("utf-8")
    except UnicodeDecodeError:
      return BadRecord("not_utf8")
    try:
      record = json.loads(text)
    except json.JSONDecodeError:
      return BadRecord("malformed")
    if not isinstance(record, dict):
      return BadRecord("malformed")
    return record if field is None else record.get(field)


class ParquetRows:
  """A Parquet file's `field` column from row `record`, one row group in memory; `field`
  None: each row whole, as a dict of its columns (preference records)."""

  def __init__(self, path: str, field: str | None, record: int):
    import pyarrow.parquet as pq

    self.path, self.field = path, field
    self._file = pq.ParquetFile(path)
    self.bad_schema = field is not None and not has_text_column(self._file.schema_arrow,
                                                                field)
    self.record = self.pos = record
    self._start, self._column = 0, None
    self._rows = self._file.metadata.num_rows

  def _load(self, row: int) -> None:
    start = 0
    for g in range(self._file.num_row_groups):
      n = self._file.metadata.row_group(g).num_rows
      if row < start + n:
        self._start = start
        if self.field is None:
          self._column = self._file.read_row_group(g).to_pylist()
        else:
          self._column = self._file.read_row_group(g, columns=[self.field]).column(0
                                                                                ).to_pylist()
        return
      start += n

  def next_for(self, shard: int, shards: int):
    self.record += (shard - self.record) % shards  # This shard's next row.
    self.pos = self.record
    if self.record >= self._rows:
      return None
    if self.bad_schema:
      return self.record, self.record, BadRecord("schema")
    if not self._start <= self.record < self._start + len(self._column or ()):
      self._load(self.record)
    return self.record, self.record, self._column[self.record - self._start]

  def advance(self) -> None:
    self.record += 1
    self.pos = self.record


class IndexedRecords:
  """A random-access source (an ArrayRecord file of JSON objects, or a prepared TFDS split)
  from record `record`: a shard's next record is found by arithmetic, not by reading."""

  def __init__(self, path: str, field: str | None, record: int):
    self.path, self.field = path, field
    if path.startswith(TFDS_PREFIX):
      self._source, self._tfds = tfds_source(path), True
    else:
      self._source, self._tfds = grain.sources.ArrayRecordDataSource([path]), False
    self._len = len(self._source)
    self.record = self.pos = record

  def next_for(self, shard: int, shards: int):
    self.record += (shard - self.record) % shards  # This shard's next record.
    self.pos = self.record
    if self.record >= self._len:
      return None
    value = self._source[self.record]
    return self.record, self.record, (self._from_tfds(value) if self._tfds
                                      else JsonLines._parse(value, self.field))

  def _from_tfds(self, example):
    if self.field is None:  # Instruction data: the features, text decoded.
      return {k: _text(v) for k, v in example.items()}
    if self.field not in example:
      return BadRecord("missing_field")
    value = _text(example[self.field])
    return value if isinstance(value, str) else BadRecord("not_utf8")

  def advance(self) -> None:
    self.record += 1
    self.pos = self.record


def open_reader(path: str, field: str | None, *, pos: int = 0, record: int = 0,
                chat: bool = False):
  """The reader of `path`'s format from byte offset `pos` (JSONL) or record `record`;
  `field` None: whole records (instruction data: JSONL and indexed formats only;
  preference records, `chat=False`: Parquet rows too).

  Raises:
    CorpusError: instruction records (`chat`) asked of a Parquet file.
  """
  fmt = format_of(path)
  if fmt == "jsonl":
    return JsonLines(path, field, pos, record)
  if fmt in ("array_record", "tfds"):
    return IndexedRecords(path, field, record)
  if chat:
    raise CorpusError(f"{path}: instruction records (config.data.chat=True) are read from "
                      f"JSONL files; this is Parquet.")
  return ParquetRows(path, field, record)


def texts(files, field: str):
  """Every record's text field of `files` in order, the records without one left out (what
  a tokenizer trains on, `trainer.data.train_tokenizer`)."""
  for path in files:
    reader = open_reader(path, field)
    while (item := reader.next_for(0, 1)) is not None:
      value = item[2]
      reader.advance()
      if isinstance(value, str) and value.strip():
        yield value


def _text(value):
  if isinstance(value, (bytes, np.bytes_)):
    try:
      return bytes(value).decode("utf-8")
    except UnicodeDecodeError:
      return None
  return value


def _parse_tfds(spec: str) -> tuple[str, str, str | None]:
  """`tfds:<name>[/<config>][@<data_dir>]:<split>` -> (name, split, data_dir)."""
  body = spec[len(TFDS_PREFIX):]
  name, _, split = body.rpartition(":")
  name, _, data_dir = name.partition("@")
  return name, split, data_dir or None


def tfds_source(spec: str):
  """The split's random-access source. Never prepares anything: a dataset that is not
  prepared as array_record is refused."""
  from trainer.data.datasets import _tfds
  name, split, data_dir = _parse_tfds(spec)
  builder = _tfds().builder(name, data_dir=data_dir)
  if not builder.is_prepared():
    raise CorpusError(f"it is not prepared in {builder.data_dir}")
  if str(builder.info.file_format) != str(_tfds().core.FileFormat.ARRAY_RECORD):
    raise CorpusError(f"it is prepared as {builder.info.file_format}, not array_record "
                      f"(random access)")
  return builder.as_data_source(split=split)


def check_tfds(spec: str, where: str) -> None:
  """A TFDS source must name a split of a dataset prepared as array_record."""
  name, split, data_dir = _parse_tfds(spec)
  if not name or not split:
    raise CorpusError(f"{where}: {spec!r} is not tfds:<name>[/<config>][@<data_dir>]:<split>.")
  try:
    tfds_source(spec)
  except Exception as e:
    raise CorpusError(f"{where}: the TFDS source {spec!r} cannot be read ({type(e).__name__}: "
                      f"{str(e)[:300]}). Prepare it first, as array_record "
                      f"(tfds.builder({name!r}).download_and_prepare(file_format="
                      f"'array_record')).") from e


def has_text_column(schema, field: str) -> bool:
  """Whether a Parquet file's (arrow) schema holds `field` as a string column."""
  return field in schema.names and str(schema.field(field).type) in ("string", "large_string")
