"""A language model's train batches from text files, on Grain: tokenized, packed or chunked,
mixed, per process, resumed exactly.

`config.data` (`configs/lm.py`) names the sources and how rows are made:

- `sources`: one entry per source, each a comma-separated list of paths, globs or
  directories of `.jsonl`/`.jsonl.gz`/`.parquet` files (`trainer.data.corpus`);
  `weights` (one per source, default equal) and `text_fields` (one per source; default
  `text_field` for each), as `eval_sources` have `eval_text_fields`;
- `tokenizer`: a `tokenizer.json` or a model directory; empty: `config.init_from.path`,
  the directory the weights come from. BOS/EOS as that directory says (`add_bos`,
  `add_eos` override);
- `layout`: `"packed"` (whole documents packed into rows by Grain's first-fit packing,
  with `segment_ids` and per-document `positions`, padding at a row's end) or
  `"chunked"` (the documents' tokens concatenated and cut into full rows, attention
  across document ends, as GPT-2 trained);
- `lanes`: the global batch's rows come from this many independent streams, lane `i`
  giving rows `i*g .. i*g + g - 1` of every batch (`g = batch_size / lanes`); each lane
  reads shard `i` of every source (`corpus.ShardIterator`). A process builds only its
  own rows' lanes, so it reads only its share of the records, and the global batch is
  the same for any number of processes that divides `lanes` (0: the largest divisor of
  `batch_size` up to 8).
- `workers`: the lanes are read, tokenized and packed in this many Grain worker
  processes (`grain.IterDataset.mp_prefetch`), each holding `worker_buffer` blocks
  ready ahead of the step; worker `w` makes every `workers`-th of this process's lanes,
  so the batches are the same for any worker count (0: in this process). It must
  divide this process's lanes.

A mixture is made per lane after packing (`grain.IterDataset.mix`): each row comes
from one source, and a source's weight is its share of rows, so of trained tokens
(up to each row's padding) rather than of documents, whose lengths differ by source.

Resuming: the iterator's state is every lane's Grain state (`get_state`), which
the loop saves with each checkpoint; restoring seeks each lane's files to where it
stopped, so a resume costs the same at step 10 as at step 10,000. On several
processes each holds its own lanes' states; a checkpoint holds all of them, gathered
when it is saved (`gather_state`, a collective every process enters at the same
save), so a run resumes on any number of processes that divides `lanes`. Each block a
worker hands over carries its lane's state after it, so the position is exact with
any number of blocks waiting in the workers' buffers, and the same for any `workers`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import grain
import ml_collections
import numpy as np

from trainer.data import corpus as corpus_lib
from trainer.data import packing
from trainer.data import workers as workers_lib
from trainer.data.corpus import TextSource, Tokenizer
from trainer.data.corpus_metrics import CorpusMetrics, skipped_records  # noqa: F401 (lm's names)
from trainer.data.positions import LANES_KEY, PROCESS_KEY, STATES_KEY, gather_state  # noqa: F401

LAYOUTS = ("packed", "chunked")
MAX_DEFAULT_LANES = 8


def lanes_for(batch_size: int, lanes: int) -> int:
  """`lanes`, or for 0 the largest divisor of `batch_size` up to `MAX_DEFAULT_LANES`.

  Raises:
    ValueError: `lanes` does not divide `batch_size` (each lane gives `batch_size / lanes`
      rows of a batch).
  """
  if not lanes:
    return max(d for d in range(1, MAX_DEFAULT_LANES + 1) if batch_size % d == 0)
  if batch_size % lanes:
    raise ValueError(f"config.data.lanes={lanes} does not divide config.batch_size="
                     f"{batch_size}; each lane gives batch_size / lanes rows of a batch.")
  return lanes


class Corpus:
  """The train batches `config.data` describes: `corpus(start_step)` is what `fit` takes.

  Args:
    sources: the resolved sources (`from_config`), each with its weight.
    tokenizer: `trainer.data.corpus.Tokenizer`.
    length: tokens per row (`config.seq_len`).
    batch_size: rows per global batch.
    rows: this process's rows of each batch (`strategy.process_slice(batch_size)`).
    lanes, layout, bad_records, shuffle_files, seed, workers, worker_buffer: see the module
      docstring.
  """

  def __init__(self, sources: Sequence[TextSource], tokenizer: Tokenizer, *, length: int,
               batch_size: int,
               rows: slice = slice(None), lanes: int = 0, layout: str = "packed",
               bad_records: str = "stop", shuffle_files: bool = True, seed: int = 0,
               epochs: int | None = None, chat: dict | None = None, workers: int = 0,
               worker_buffer: int = 2, encode=None):
    # Whole records each made into one row (`corpus.ShardIterator`'s `encode`: preference
    # pairs), neither packed nor chunked; None: documents packed or chunked.
    self.encode = encode
    self.epochs = epochs  # None: endless (training); 1: one pass (held-out data).
    self.chat = chat  # Instruction records (`chat.messages_of`'s field names), or None.
    self.sources, self.tokenizer = tuple(sources), tokenizer
    self.length, self.batch_size, self.layout = length, batch_size, layout
    self.bad_records, self.shuffle_files, self.seed = bad_records, shuffle_files, seed
    self.lanes = lanes_for(batch_size, lanes)
    self.rows_per_lane = batch_size // self.lanes
    start, stop, _ = rows.indices(batch_size)
    if start % self.rows_per_lane or stop % self.rows_per_lane:
      raise ValueError(
          f"this process feeds rows {start}:{stop} of each config.batch_size={batch_size} "
          f"batch, which do not fall on the {self.lanes} lanes of {self.rows_per_lane} rows "
          f"(config.data.lanes={lanes}); the processes that split a batch must divide "
          f"the lanes.")
    self.my_lanes = range(start // self.rows_per_lane, stop // self.rows_per_lane)
    # A finite pass (held-out data) is read in this process: lanes that end at different
    # batches would leave the workers' turns out of step.
    self.workers = workers if epochs is None else 0
    self.worker_buffer = worker_buffer
    check_workers(self.workers, worker_buffer, len(self.my_lanes))

  # -- One lane ----------------------------------------------------------------------------

  def lane_rows(self, lane: int) -> grain.IterDataset:
    """Lane `lane`'s rows, one at a time: each source's packed (or chunked), mixed."""
    per_source = [self._rows(i, source, lane) for i, source in enumerate(self.sources)]
    return per_source[0] if len(per_source) == 1 else grain.IterDataset.mix(
        per_source, [source.weight for source in self.sources])

  def lane_dataset(self, lane: int) -> grain.IterDataset:
    """Lane `lane`'s rows, `rows_per_lane` at a time (one block of each global batch)."""
    return self.lane_rows(lane).batch(self.rows_per_lane, drop_remainder=True)

  def _rows(self, index: int, source: TextSource, lane: int) -> grain.IterDataset:
    examples = corpus_lib.shard_dataset(
        source, self.tokenizer, length=self.length, shard=lane, shards=self.lanes,
        seed=(self.seed, index), bad_records=self.bad_records, shuffle=self.shuffle_files,
        epochs=self.epochs, chat=self.chat, encode=self.encode)
    if self.encode is not None:  # One row a record, already of the row's shape.
      return examples
    lengths = {"inputs": self.length, "targets": self.length}
    if self.chat is not None:
      lengths[corpus_lib.WEIGHTS] = self.length
    if self.layout == "chunked":  # Full rows only: a finite pass's padded remainder is cut.
      return grain.experimental.ConcatThenSplitIterDataset(
          examples, length_struct=lengths).filter(_is_full).map(_chunked_row)
    packed = grain.experimental.FirstFitPackIterDataset(
        examples, length_struct=lengths, num_packing_bins=self.rows_per_lane,
        shuffle_bins=False)
    return packed.map(_packed_row)

  # -- What `fit` takes ------------------------------------------------------------------------

  def __call__(self, start_step: int = 0) -> CorpusIterator:
    return CorpusIterator(self, start_step)


def _weights(row: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
  if corpus_lib.WEIGHTS not in row:
    return {}
  return {packing.LOSS_WEIGHTS: np.asarray(row[corpus_lib.WEIGHTS], np.float32)}


def _is_full(row: Mapping[str, np.ndarray]) -> bool:
  return bool(np.all(row["inputs_segment_ids"] > 0))


def _chunked_row(row: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
  return {**{k: np.asarray(row[k], np.int32) for k in ("inputs", "targets")}, **_weights(row)}


def _packed_row(row: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
  return {"inputs": np.asarray(row["inputs"], np.int32),
          "targets": np.asarray(row["targets"], np.int32),
          packing.SEGMENT_IDS: np.asarray(row["inputs_segment_ids"], np.int32),
          packing.POSITIONS: np.asarray(row["inputs_positions"], np.int32), **_weights(row)}


class LaneGroup(grain.IterDataset):
  """Lanes of a corpus as one dataset, for one process or (`set_slice`, which grain's
  `mp_prefetch` calls in each worker) one worker: each element is `{lane: (block of
  rows_per_lane rows, the lane's Grain state after it)}`. `states` starts each lane
  where a saved position left it (None: at the start)."""

  def __init__(self, corpus: Corpus, lanes: Sequence[int],
               states: Mapping[str, Any] | None = None):
    super().__init__()
    self.corpus, self.lanes, self.states = corpus, tuple(lanes), states

  def set_slice(self, sl: slice, sequential_slice: bool = False) -> None:
    del sequential_slice  # Worker `w` of `n` takes every n-th lane from the w-th.
    self.lanes = self.lanes[sl]

  def __iter__(self) -> _LaneGroupIterator:
    return _LaneGroupIterator(self.corpus, self.lanes, self.states)


def _lane_states(element: Mapping[str, tuple[Any, Any]]) -> dict[str, Any]:
  """The Grain state of each lane of a lane group's element (`{lane: (block, state)}`)."""
  return {lane: state for lane, (_, state) in element.items()}


class _LaneGroupIterator(grain.DatasetIterator):

  def __init__(self, corpus: Corpus, lanes: Sequence[int], states: Mapping[str, Any] | None):
    super().__init__()
    self._iterators = {str(lane): iter(corpus.lane_dataset(lane)) for lane in lanes}
    if states is not None:
      for lane, it in self._iterators.items():
        it.set_state(states[lane])
    self._states = None  # After the last element: what grain's worker asks for next.

  def __next__(self) -> dict[str, tuple[dict[str, np.ndarray], Any]]:
    element = {}
    for lane, it in self._iterators.items():
      block = next(it)
      element[lane] = (block, it.get_state())
    self._states = _lane_states(element)
    return element

  def get_state(self) -> dict[str, Any]:
    if self._states is None:
      self._states = {lane: it.get_state() for lane, it in self._iterators.items()}
    return dict(self._states)

  def set_state(self, state: Mapping[str, Any]) -> None:
    for lane, it in self._iterators.items():
      it.set_state(state[lane])
    self._states = None


class CorpusIterator:
  """This process's rows of global batches `start, start + 1, ...`: its lanes' blocks side
  by side, made in `corpus.workers` Grain worker processes (or in this one). `get_state()`
  holds its lanes' Grain states; `set_state` takes a checkpoint's (all lanes',
  `gather_state`) or this process's own. The workers start at the first batch read, from
  the position set last; `close()` stops them."""

  def __init__(self, corpus: Corpus, start: int = 0):
    self.corpus = corpus
    self._states: dict[str, Any] | None = None  # After the last batch; None: the start.
    self._blocks = None  # The lanes' blocks, started at the first read.
    self._stop = None  # Stops the workers (`weakref.finalize`), once started.
    self._start = start  # Batches to skip at the first `next` unless a state is set.

  def __iter__(self) -> CorpusIterator:
    return self

  def _open(self):
    group = LaneGroup(self.corpus, self.corpus.my_lanes, self._states)
    if not self.corpus.workers:
      return iter(group)
    blocks, self._stop = workers_lib.start(group, self, workers=self.corpus.workers,
                                           buffer=self.corpus.worker_buffer)
    return blocks

  def __next__(self) -> dict[str, np.ndarray]:
    if self._blocks is None:
      self._blocks = self._open()
    if self._start:  # No saved position to seek to: read up to the start (O(start)).
      start, self._start = self._start, 0
      for _ in range(start):
        next(self)
    lanes = {}
    for _ in range(max(self.corpus.workers, 1)):  # One element from each worker in turn.
      lanes.update(next(self._blocks))
    self._states = _lane_states(lanes)
    blocks = [lanes[str(lane)][0] for lane in self.corpus.my_lanes]
    return {k: np.concatenate([b[k] for b in blocks]) for k in blocks[0]}

  def get_state(self) -> dict[str, Any]:
    states = self._states
    if states is None:  # Nothing read: each lane's start.
      states = _LaneGroupIterator(self.corpus, self.corpus.my_lanes, None).get_state()
    return {LANES_KEY: self.corpus.lanes, PROCESS_KEY: True, STATES_KEY: dict(states)}

  def set_state(self, state: Mapping[str, Any]) -> None:
    check_state(state, self.corpus.lanes)
    states = state[STATES_KEY]
    mine = [str(lane) for lane in self.corpus.my_lanes]
    missing = [int(lane) for lane in mine if lane not in states]
    if missing:
      raise ValueError(f"the train data state holds lanes {sorted(map(int, states))}; this "
                       f"process reads lanes {list(self.corpus.my_lanes)} ({missing} "
                       f"missing): a state of one process's lanes resumes on that process "
                       f"only.")
    self.close()
    self._states = {lane: states[lane] for lane in mine}
    self._start = 0

  def skipped(self) -> dict[str, int]:
    """Bad records skipped by this process's lanes so far, by kind."""
    return skipped_records(self.get_state())

  def close(self) -> None:
    """Stops the worker processes (they start again at the next read)."""
    stop, self._stop, self._blocks = self._stop, None, None
    if stop is not None:
      stop()


def check_workers(workers: Any, worker_buffer: Any, lanes: int) -> None:
  """Raises unless `workers` worker processes can share `lanes` lanes evenly."""
  if not isinstance(workers, int) or workers < 0:
    raise ValueError(f"config.data.workers={workers!r} must be an integer >= 0 (0: read in "
                     f"the training process).")
  if not isinstance(worker_buffer, int) or worker_buffer < 1:
    raise ValueError(f"config.data.worker_buffer={worker_buffer!r} must be an integer >= 1.")
  if workers and lanes % workers:
    raise ValueError(f"config.data.workers={workers} does not divide the {lanes} lanes this "
                     f"process reads: each worker makes an equal share of them. Use a divisor "
                     f"of {lanes}, or set config.data.lanes.")


def check_state(state: Any, lanes: int) -> None:
  """Raises unless `state` is a corpus state of `lanes` lanes."""
  if not isinstance(state, Mapping) or LANES_KEY not in state:
    raise ValueError(f"train data state {str(state)[:200]!r} is not a corpus position "
                     f"(trainer.data.lm); the checkpoint was written by another pipeline.")
  if state[LANES_KEY] != lanes:
    raise ValueError(f"the checkpoint's train data position is over {state[LANES_KEY]} "
                     f"lanes, but this run reads {lanes} (config.data.lanes, or "
                     f"config.batch_size for lanes=0). Each lane is its own stream, so the "
                     f"data cannot continue on another number of lanes: set "
                     f"config.data.lanes={state[LANES_KEY]}.")


# -- From the config -------------------------------------------------------------------------


def check_config(config: ml_collections.ConfigDict, *, schemas: bool = True
                 ) -> list[TextSource]:
  """Raises for the first `config.data` field a corpus run cannot take (before any compute):
  a file that does not exist, a glob that matches none, weights that do not match the
  sources, a layout or policy not among those accepted. Returns the resolved sources
  ([] without sources)."""
  data = config.data
  if not data.sources:
    return []
  if isinstance(data.sources, str):
    raise ValueError(f"config.data.sources={data.sources!r} must be a tuple of sources "
                     f"(one string each), e.g. ({data.sources!r},).")
  if data.layout not in LAYOUTS:
    raise ValueError(f"config.data.layout={data.layout!r} is not one of {LAYOUTS}.")
  if data.bad_records not in corpus_lib.BAD_RECORDS:
    raise ValueError(f"config.data.bad_records={data.bad_records!r} is not one of "
                     f"{corpus_lib.BAD_RECORDS}.")
  if data.weights and len(data.weights) != len(data.sources):
    raise ValueError(f"config.data.weights={tuple(data.weights)} has {len(data.weights)} "
                     f"weights for {len(data.sources)} sources; give one per source, or none "
                     f"(equal).")
  fields = tuple(data.text_fields)
  if fields and (len(fields) != len(data.sources)
                 or not all(isinstance(f, str) and f for f in fields)):
    raise ValueError(f"config.data.text_fields={fields} must name one field per source "
                     f"({len(data.sources)} sources), or none (config.data.text_field="
                     f"{data.text_field!r} for each).")
  eval_fields = tuple(data.eval_text_fields)
  if eval_fields and len(eval_fields) != len(data.eval_sources):
    raise ValueError(f"config.data.eval_text_fields={eval_fields} must name one field per "
                     f"eval source ({len(data.eval_sources)}), or none.")
  if not isinstance(data.lanes, int) or data.lanes < 0:
    raise ValueError(f"config.data.lanes={data.lanes!r} must be an integer >= 0 (0: "
                     f"automatic).")
  check_workers(data.workers, data.worker_buffer, lanes_for(config.batch_size, data.lanes))
  sources = resolve_sources(config)
  for source in sources if schemas else ():  # (Preference records check their own.)
    corpus_lib.check_schemas(source, data.bad_records)
  tokenizer_path(config)
  return sources


def resolve_sources(config) -> list[TextSource]:
  """`config.data.sources`, each with its weight and its text field (`text_fields`, one per
  source; empty: `text_field` for each)."""
  data = config.data
  weights = tuple(data.weights) or (1.0,) * len(data.sources)
  fields = tuple(data.text_fields) or (data.text_field,) * len(data.sources)
  return [corpus_lib.resolve(spec, field=field, weight=w, where=f"config.data.sources[{i}]")
          for i, (spec, w, field) in enumerate(zip(data.sources, weights, fields, strict=True))]


def tokenizer_path(config) -> str:
  path = config.data.tokenizer or config.init_from.path
  if not path:
    raise ValueError("config.data.tokenizer is empty and so is config.init_from.path: name a "
                     "tokenizer.json, or the model directory the weights come from.")
  return path


def tokenizer_of(config) -> Tokenizer:
  """The run's tokenizer (`tokenizer_path`, BOS/EOS as `config.data` says).

  Raises:
    ValueError: it holds more tokens than `config.model.vocab_size`.
  """
  data = config.data
  tokenizer = Tokenizer(tokenizer_path(config), add_bos=data.add_bos, add_eos=data.add_eos)
  if "model" in config and tokenizer.vocab_size > config.model.vocab_size:
    raise ValueError(f"the tokenizer {tokenizer.path} has {tokenizer.vocab_size} tokens but "
                     f"config.model.vocab_size={config.model.vocab_size}.")
  return tokenizer


def from_config(config, rows: slice = slice(None), epochs: int | None = None) -> Corpus:
  """The `Corpus` of `config.data` for this process's `rows`
  (`trainer.strategy.process_slice(config.batch_size)`), endless or `epochs` passes; with
  `config.data.member_sources`, every member's (`trainer.data.members`)."""
  if config.data.member_sources:
    from trainer.data import members
    return members.from_config(config, lambda one: from_config(one, rows, epochs))
  sources = check_config(config)
  data = config.data
  tokenizer = tokenizer_of(config)
  chat = None
  if data.chat:
    tokenizer.chat_template()  # Refused here if the model directory has none.
    chat = dict(messages_field=data.messages_field, prompt_field=data.prompt_field,
                response_field=data.response_field)
  return Corpus(sources, tokenizer, length=config.seq_len, batch_size=config.batch_size,
                rows=rows, lanes=data.lanes, layout=data.layout,
                bad_records=data.bad_records, shuffle_files=data.shuffle_files,
                seed=config.seed, epochs=epochs, chat=chat, workers=data.workers,
                worker_buffer=data.worker_buffer)


def held_out_config(config) -> ml_collections.ConfigDict:
  """`config` for one ordered pass over `config.data.eval_sources`: those sources (with
  `eval_text_fields`), in one lane, files unshuffled, read in this process (no workers:
  lanes that end at different batches would leave the workers' turns out of step), in
  batches of `config.eval_batch_size`. The same on every process and in every run."""
  data = config.data
  held_out = ml_collections.ConfigDict(config.to_dict())
  with held_out.unlocked():
    held_out.data.update(sources=tuple(data.eval_sources), weights=(), lanes=1, workers=0,
                         shuffle_files=False, text_fields=tuple(data.eval_text_fields))
    held_out.batch_size = config.eval_batch_size
  return held_out


def eval_batches(config) -> list[dict[str, np.ndarray]]:
  """Up to `config.data.eval_batches` global batches of `config.eval_batch_size` rows from
  one pass over `config.data.eval_sources` (`held_out_config`); [] without eval sources.
  With `config.data.member_sources`, every member's, stacked (`trainer.data.members`)."""
  if config.data.member_sources:
    from trainer.data import members
    return members.eval_batches(config, eval_batches)
  if not config.data.eval_sources:
    return []
  return first_batches(from_config(held_out_config(config), epochs=1)(), config, "rows")


def first_batches(iterator, config, what: str) -> list[dict[str, np.ndarray]]:
  """Up to `config.data.eval_batches` batches of a finite held-out `iterator`.

  Raises:
    ValueError: it holds less than one batch (of `config.eval_batch_size` `what`).
  """
  import itertools
  batches = list(itertools.islice(iterator, config.data.eval_batches))
  if not batches:
    raise ValueError(f"config.data.eval_sources={tuple(config.data.eval_sources)} hold fewer "
                     f"than one batch of config.eval_batch_size={config.eval_batch_size} "
                     f"{what}.")
  return batches
