"""A text corpus as train batches (`trainer.data.lm`, `trainer.data.corpus`): files streamed,
tokenized, packed or chunked, mixed, per process, resumed exactly; bad input refused or
counted.

The corpora are written by `corpus_files`: document `d` is the word `w<d>` repeated, and
the tokenizer gives each word its own id, so a trained token says which document it
came from.
"""

import collections
import json
import math
import os
import pathlib
import signal
import subprocess
import sys

import corpus_files as cf
import ml_collections
import numpy as np
import pytest

from configs import lm as lm_config
from trainer.data import corpus, lm, packing

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
LENGTH = 16


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  return cf.write_corpus(tmp_path_factory.mktemp("corpus"))


def make(files, sources=("corpus",), weights=None, *, batch_size=8, lanes=0, rows=slice(None),
         layout="packed", bad_records="stop", epochs=None, add_bos=None, workers=0):
  root = files["tokenizer"]
  resolved = [corpus.resolve(str(root / s), field="text", weight=w, where=f"sources[{i}]")
              for i, (s, w) in enumerate(zip(sources, weights or [1.0] * len(sources),
                                             strict=True))]
  tokenizer = corpus.Tokenizer(str(root), add_bos=add_bos)
  return lm.Corpus(resolved, tokenizer, length=LENGTH,
                   batch_size=batch_size, rows=rows, lanes=lanes, layout=layout,
                   bad_records=bad_records, seed=3, epochs=epochs, workers=workers)


def one_pass(c):
  """Every row of every lane for `c`'s one epoch."""
  rows = []
  for lane in range(c.lanes):
    rows.extend(c.lane_rows(lane))
  return rows


def target_counts(rows) -> collections.Counter:
  """Trained targets per document (padding and EOS left out)."""
  counts = collections.Counter()
  for row in rows:
    real = row[packing.SEGMENT_IDS] > 0 if packing.SEGMENT_IDS in row else np.ones_like(
        row["targets"], bool)
    for token in np.asarray(row["targets"])[real]:
      if cf.doc_of(int(token)) is not None:
        counts[cf.doc_of(int(token))] += 1
  return counts


def test_a_pass_trains_every_token_of_every_document_once(files):
  expected = dict(enumerate(cf.lengths(60)))  # Words per document: each a target once.
  c = make(files, lanes=2, epochs=1)
  rows = one_pass(c)
  assert dict(target_counts(rows)) == expected
  batch = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
  packing.check_packed(batch)  # Segment ids and per-document positions as the models take.
  # Packing: rows hold several documents, and the documents longer than a row are cut.
  assert batch[packing.SEGMENT_IDS].max() > 1
  assert len(rows) < sum(n + 1 for n in expected.values()) / LENGTH * 2


def test_chunked_rows_are_full_and_hold_the_documents_in_order(files):
  c = make(files, lanes=1, layout="chunked", epochs=1)
  rows = one_pass(c)
  assert set(rows[0]) == {"inputs", "targets"}
  counts = target_counts(rows[:-1])  # The last row may be the pass's remainder.
  assert sum(counts.values()) >= sum(cf.lengths(60)) - 2 * LENGTH
  full = np.stack([r["inputs"] for r in rows[:-1]])
  assert (full > 0).all()  # No padding: the token stream cut into rows.


def test_the_global_batch_is_the_same_for_1_2_and_4_processes(files):
  whole = make(files)()
  reference = [next(whole) for _ in range(6)]
  for processes in (2, 4):
    share = 8 // processes
    parts = [make(files, rows=slice(p * share, (p + 1) * share))() for p in range(processes)]
    for batch in reference:
      got = [next(part) for part in parts]
      for key, value in batch.items():
        np.testing.assert_array_equal(np.concatenate([g[key] for g in got]), value)
  # Each process reads its own records: over a pass, the documents its lanes train on
  # are disjoint from the other process's.
  halves = [target_counts(r for lane in make(files, rows=slice(p * 4, p * 4 + 4),
                                             epochs=1).my_lanes
                          for r in make(files, epochs=1).lane_rows(lane)) for p in (0, 1)]
  assert halves[0] and halves[1] and not set(halves[0]) & set(halves[1])


def test_lanes_that_the_processes_do_not_divide_are_refused(files):
  with pytest.raises(ValueError, match=r"rows 0:3 .* 4 lanes of 2 rows"):
    make(files, lanes=4, rows=slice(0, 3))


def test_a_saved_position_resumes_the_same_batches(files):
  for layout in ("packed", "chunked"):
    c = make(files, ["corpus/a.jsonl", "corpus/c.parquet"], [0.6, 0.4], layout=layout)
    reference = c()
    batches = [next(reference) for _ in range(20)]
    first = c()
    for _ in range(9):
      next(first)
    state = json.loads(json.dumps(lm.gather_state(first.get_state())))  # As saved.
    resumed = c()
    resumed.set_state(state)
    for expected in batches[9:]:
      got = next(resumed)
      for key in expected:
        np.testing.assert_array_equal(got[key], expected[key], err_msg=f"{layout} {key}")
    # A lane's position is where its files stand, not a count of batches to skip.
    lane = json.dumps(state[lm.STATES_KEY]["0"])
    assert '"pos": ' in lane and '"epoch": 0' in lane, lane


def test_worker_processes_make_the_same_batches_and_positions_as_the_training_process(
    files, monkeypatch):
  """Two Grain workers, two of the four lanes each: the batches and the positions after each
  batch are those read in this process; a position saved under either resumes under the
  other. The workers tokenize: this process's tokenizer is never called."""
  sources = ["corpus/a.jsonl", "corpus/c.parquet"]
  here = make(files, sources, [0.6, 0.4], lanes=4)()
  expected = []
  for _ in range(6):
    expected.append((next(here), json.dumps(here.get_state(), sort_keys=True)))

  def refuse(self, text):
    raise AssertionError("tokenized in the training process")

  monkeypatch.setattr(corpus.Tokenizer, "__call__", refuse)
  workers = make(files, sources, [0.6, 0.4], lanes=4, workers=2)()
  try:
    for batch, state in expected:
      got = next(workers)
      for key in batch:
        np.testing.assert_array_equal(got[key], batch[key], err_msg=key)
      assert json.dumps(workers.get_state(), sort_keys=True) == state
    # A position from the workers resumes in this process, and one from here in workers.
    workers.set_state(json.loads(expected[1][1]))
    for batch, _ in expected[2:4]:
      np.testing.assert_array_equal(next(workers)["targets"], batch["targets"])
  finally:
    workers.close()
  monkeypatch.undo()
  resumed = make(files, sources, [0.6, 0.4], lanes=4)()
  resumed.set_state(json.loads(expected[3][1]))
  np.testing.assert_array_equal(next(resumed)["targets"], expected[4][0]["targets"])
  monkeypatch.setattr(corpus.Tokenizer, "__call__", refuse)
  with pytest.raises(AssertionError, match="tokenized in"):  # Without workers: called here.
    next(make(files, sources, [0.6, 0.4], lanes=4)())


def test_a_position_over_other_lanes_is_refused(files):
  saved = make(files, lanes=4)()
  next(saved)
  state = lm.gather_state(saved.get_state())
  with pytest.raises(ValueError, match=r"over 4 lanes, but this run reads 8 .* "
                                       r"config.data.lanes=4"):
    make(files, lanes=8)().set_state(state)


def test_a_mixtures_row_shares_are_within_the_binomial_bound_of_the_weights(files):
  weights = [0.75, 0.25]
  c = make(files, ["corpus/a.jsonl", "corpus/c.parquet"], weights)
  docs_a = set(range(20))  # a.jsonl holds documents 0-19, c.parquet 40-59.
  iterator, rows, from_a = c(), 0, 0
  for _ in range(50):
    batch = next(iterator)
    for row in batch["targets"]:
      docs = {cf.doc_of(int(t)) for t in row} - {None}
      assert docs <= docs_a or not docs & docs_a  # Each row from one source.
      rows += 1
      from_a += bool(docs & docs_a)
  share, w = from_a / rows, weights[0]
  assert abs(share - w) <= 3 * math.sqrt(w * (1 - w) / rows), (share, rows)


def test_the_tokenizer_brackets_documents_as_the_model_directory_says(tmp_path):
  cf.write_tokenizer(tmp_path / "bos", add_bos=True)
  cf.write_tokenizer(tmp_path / "nobos", add_bos=False)
  text = cf.document(5, 3)
  assert corpus.Tokenizer(str(tmp_path / "bos"))(text).tolist() == [1, 8, 8, 8, 2]
  assert corpus.Tokenizer(str(tmp_path / "nobos"))(text).tolist() == [8, 8, 8, 2]
  assert corpus.Tokenizer(str(tmp_path / "nobos" / "tokenizer.json"), add_bos=True,
                          add_eos=False)(text).tolist() == [1, 8, 8, 8]


BAD_LINES = {
    "malformed": ('{"text": "w1 w1', "line 3 is not a JSON object"),
    "missing_field": ('{"body": "w1 w1"}', "line 3 has no text field 'text'"),
    "empty": ('{"text": "   "}', "line 3 is an empty document"),
}


@pytest.mark.parametrize("kind", [*BAD_LINES, "not_utf8"])
def test_a_bad_record_stops_the_run_naming_the_file_and_line_or_is_counted(tmp_path, kind):
  root = cf.write_tokenizer(tmp_path)
  path = cf.write_jsonl(tmp_path / "bad.jsonl", [(1, 4), (2, 4)],
                        lines=[BAD_LINES[kind][0]] if kind in BAD_LINES else None)
  if kind == "not_utf8":
    with open(path, "ab") as f:
      f.write(b'{"text": "w1 \xff\xfe"}\n')
  message = BAD_LINES.get(kind, (None, "line 3 is not UTF-8 text"))[1]
  source = corpus.resolve(str(path), field="text", weight=1.0, where="sources[0]")
  tokenizer = corpus.Tokenizer(str(root))
  # Read in a worker process (one kind: each starts one), the error reaches the run as it is.
  for workers in (0, 1) if kind == "malformed" else (0,):
    stop = lm.Corpus([source], tokenizer, length=LENGTH, batch_size=1, workers=workers)()
    with pytest.raises(corpus.CorpusError, match=rf"bad\.jsonl: {message}.*'skip'"):
      for _ in range(10):
        next(stop)
    stop.close()
  skip = lm.Corpus([source], tokenizer, length=LENGTH, batch_size=1,
                   bad_records="skip")()
  for _ in range(10):  # Three passes over the file: the bad line counted each time.
    next(skip)
  counts = skip.skipped()
  assert counts[kind] >= 3 and sum(counts.values()) == counts[kind]


def test_a_parquet_file_of_another_schema_is_refused_before_compute(tmp_path, files):
  cf.write_parquet(tmp_path / "other.parquet", [(1, 3)], column="body")
  config = corpus_config(files, sources=(str(tmp_path / "other.parquet"),))
  with pytest.raises(corpus.CorpusError, match=r"other\.parquet: no string column 'text' "
                                               r"\(its columns: \{'body': 'string'\}\)"):
    lm.check_config(config)
  config.data.bad_records = "skip"
  lm.check_config(config)  # Skipped and counted instead.
  source = corpus.resolve(str(tmp_path / "other.parquet"), field="text", weight=1.0,
                          where="s")
  shard = corpus.ShardIterator(source, corpus.Tokenizer(str(files["tokenizer"])),
                               length=LENGTH, shard=0, shards=1, seed=0, bad_records="skip")
  with pytest.raises(corpus.CorpusError, match="holds no readable record"):
    next(shard)
  assert shard.skipped["schema"] == 2  # One row, two passes, then refused as empty.


def corpus_config(files, **data) -> ml_collections.ConfigDict:
  config = lm_config.get_config()
  config.model.vocab_size = 256
  config.seq_len = LENGTH
  config.batch_size = 8
  config.data.update(sources=(str(files["a"]),), tokenizer=str(files["tokenizer"]))
  config.data.update(data)
  return config


@pytest.mark.parametrize("fields, message", [
    (dict(sources=("/nonexistent/x.jsonl",)), r"sources\[0\]: the path '/nonexistent/x.jsonl' "
                                              r"matches no file"),
    (dict(sources=("/nonexistent/*.jsonl",)), r"sources\[0\]: the glob '/nonexistent/\*.jsonl'"
                                              r" matches no file"),
    (dict(weights=(0.5, 0.5)), r"config.data.weights=\(0.5, 0.5\) has 2 weights for 1 sources"),
    (dict(layout="shuffled"), r"config.data.layout='shuffled' is not one of \('packed', "),
    (dict(bad_records="ignore"), r"config.data.bad_records='ignore' is not one of"),
    (dict(lanes=3), r"config.data.lanes=3 does not divide config.batch_size=8"),
    (dict(workers=3), r"config.data.workers=3 does not divide the 8 lanes this process"),
    (dict(workers=-1), r"config.data.workers=-1 must be an integer >= 0"),
    (dict(worker_buffer=0), r"config.data.worker_buffer=0 must be an integer >= 1"),
    (dict(tokenizer=""), r"config.data.tokenizer is empty and so is config.init_from.path"),
])
def test_a_corpus_config_that_cannot_run_is_refused_before_compute(files, fields, message):
  config = corpus_config(files, **fields)
  with pytest.raises(ValueError, match=message):
    from trainer.config import check_config
    check_config(config)


def test_held_out_data_is_read_in_this_process_whatever_the_workers(files):
  """`config.data.workers=2` trains in two workers; the held-out pass (one lane) is read
  here, the same batches as with no workers."""
  batches = {}
  for workers in (0, 2):
    config = corpus_config(files, workers=workers, eval_sources=(str(files["b"]),))
    config.eval_batch_size = 2
    from trainer.config import check_config
    check_config(config)
    batches[workers] = lm.eval_batches(config)
  assert len(batches[2]) == len(batches[0]) > 0
  for a, b in zip(batches[0], batches[2], strict=True):
    np.testing.assert_array_equal(a["targets"], b["targets"])


def test_a_run_killed_mid_epoch_resumes_the_same_batches_and_parameters(tmp_path, files):
  """SIGKILL at step 7 (checkpoint at 4, mid-epoch), then the same command: every step's
  batch and the final parameters equal the uninterrupted run's, bitwise."""
  def run(workdir, *extra):
    return subprocess.run([sys.executable, str(HERE / "corpus_run.py"), f"--workdir={workdir}",
                           f"--corpus={files['tokenizer']}", *extra], capture_output=True,
                          text=True, timeout=600, cwd=ROOT)

  whole = run(tmp_path / "whole")
  assert whole.returncode == 0, whole.stderr[-3000:]
  killed = run(tmp_path / "killed", "--kill_at=7")
  assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
  resumed = run(tmp_path / "killed")
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "Resuming at step 4" in resumed.stderr

  def batches(workdir):
    seen = {}
    for line in (workdir / "batches.jsonl").read_text().splitlines():
      record = json.loads(line)
      seen.setdefault(record["step"], []).append(record["digest"])
    return seen

  reference, replayed = batches(tmp_path / "whole"), batches(tmp_path / "killed")
  assert sorted(reference) == list(range(12))
  for step in range(12):  # Steps 4-6 were read twice: before the kill and after it.
    assert set(replayed[step]) == {reference[step][0]}, step
  a, b = (np.load(tmp_path / d / "final.npz") for d in ("whole", "killed"))
  assert sorted(a.files) == sorted(b.files)
  for name in a.files:
    np.testing.assert_array_equal(a[name], b[name], err_msg=name)
  assert os.path.exists(tmp_path / "killed" / "checkpoints" / "12")


# -- Instruction data ------------------------------------------------------------------------

CONVERSATIONS = [
    [{"role": "user", "content": "what is the capital of france"},
     {"role": "assistant", "content": "paris is the capital"}],
    [{"role": "system", "content": "you are a helpful assistant"},
     {"role": "user", "content": "capital of france ?"},
     {"role": "assistant", "content": " paris "},
     {"role": "user", "content": "what is the capital"},
     {"role": "assistant", "content": "paris"}],
]


@pytest.mark.parametrize("template", ["LLAMA3_TEMPLATE", "CHATML_TEMPLATE"])
def test_a_chat_template_renders_as_transformers_and_weighs_the_assistant_turns(tmp_path,
                                                                                 template):
  transformers = pytest.importorskip("transformers")
  root = cf.write_chat_tokenizer(tmp_path, getattr(cf, template))
  theirs = transformers.AutoTokenizer.from_pretrained(str(root))
  ours = corpus.Tokenizer(str(root))
  for messages in CONVERSATIONS:
    text, spans = ours.chat_template().render_with_spans(messages)
    assert text == theirs.apply_chat_template(messages, tokenize=False)
    assert ours.chat_template().render(messages[:1], add_generation_prompt=True) == \
        theirs.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    ids, weights = ours.encode_chat(messages)
    encoded = theirs.apply_chat_template(messages, tokenize=True)
    assert ids.tolist() == list(getattr(encoded, "input_ids", None) or encoded["input_ids"]
                                if not isinstance(encoded, list) else encoded)
    # The weighted tokens are the assistant turns (and their end-of-turn tokens), in order.
    trained = ours.tokenizer.decode(ids[weights > 0].tolist(), skip_special_tokens=False)
    turns = "".join(text[a:b] for a, b in spans)
    assert trained == turns
    assert all(m["content"].strip() in turns for m in messages if m["role"] == "assistant")
    assert not any(m["content"] in turns for m in messages if m["role"] == "user")


def test_the_loss_covers_the_response_tokens_alone(tmp_path):
  from trainer.language_model import LanguageModelTrainer

  root = cf.write_chat_tokenizer(tmp_path, cf.LLAMA3_TEMPLATE)
  records = tmp_path / "chat.jsonl"
  records.write_text("".join(json.dumps(r) + "\n" for r in [
      {"prompt": "what is the capital of france", "response": "paris is the capital"},
      {"messages": CONVERSATIONS[1]}] * 4))
  config = corpus_config({"tokenizer": root, "a": records}, chat=True, lanes=1)
  config.model.vocab_size = 320
  config.seq_len = 32
  batch = next(lm.from_config(config)())
  weights = batch[packing.LOSS_WEIGHTS]
  real = batch[packing.SEGMENT_IDS] > 0
  assert weights.dtype == np.float32 and set(np.unique(weights)) == {0.0, 1.0}
  assert (weights[~real] == 0).all() and 0 < weights.sum() < real.sum()
  trainer = LanguageModelTrainer(config)
  logits = np.random.default_rng(0).normal(size=(*batch["targets"].shape, 320)).astype(
      np.float32)

  def loss(targets):
    return np.asarray(trainer.loss(logits, {**batch, "targets": targets}))

  base = loss(batch["targets"])
  row, col = np.argwhere(real & (weights == 0))[0]  # A prompt token's target.
  changed = batch["targets"].copy()
  changed[row, col] = (changed[row, col] + 1) % 300
  np.testing.assert_array_equal(loss(changed), base)
  row, col = np.argwhere(weights == 1)[0]  # A response token's target.
  changed = batch["targets"].copy()
  changed[row, col] = (changed[row, col] + 1) % 300
  assert loss(changed)[row] != base[row]


def test_instruction_data_without_a_template_or_turns_is_refused(tmp_path, files):
  records = tmp_path / "chat.jsonl"
  records.write_text(json.dumps({"prompt": "w1", "answer": "w2"}) + "\n")
  config = corpus_config(files, sources=(str(records),), chat=True)
  from trainer.data.chat import ChatError
  with pytest.raises(ChatError, match=r"tokenizer_config.json has no chat_template"):
    lm.from_config(config)
  root = cf.write_chat_tokenizer(tmp_path / "model", cf.CHATML_TEMPLATE)
  config.data.tokenizer = str(root)
  config.model.vocab_size = 320
  with pytest.raises(corpus.CorpusError, match=r"chat.jsonl: line 1 has neither a 'messages' "
                                               r"list .* 'prompt' and 'response' fields"):
    next(lm.from_config(config)())


# -- Random-access sources: ArrayRecord, a TFDS text dataset ---------------------------------


def test_array_record_and_tfds_sources_train_every_document_once_a_pass(tmp_path, files):
  sizes = list(enumerate(cf.lengths(30, seed=1)))
  record_file = cf.write_array_record(tmp_path / "docs.array_record", sizes[:15])
  spec = cf.write_tfds_text(tmp_path / "tfds", sizes[15:])
  tokenizer = corpus.Tokenizer(str(files["tokenizer"]))
  sources = [corpus.resolve(str(record_file), field="text", weight=1.0, where="s0"),
             corpus.resolve(spec, field="text", weight=1.0, where="s1")]
  assert sources[1].files == (spec,)
  for source, part in zip(sources, (sizes[:15], sizes[15:]), strict=True):
    c = lm.Corpus([source], tokenizer, length=LENGTH, batch_size=4, lanes=2, epochs=1)
    assert dict(target_counts(one_pass(c))) == dict(part)
  # Resumed from a saved position: the same batches.
  c = lm.Corpus(sources, tokenizer, length=LENGTH, batch_size=4, lanes=2)  # Equal weights.
  reference, first = c(), c()
  expected = [next(reference) for _ in range(12)]
  for _ in range(5):
    next(first)
  resumed = c()
  resumed.set_state(json.loads(json.dumps(lm.gather_state(first.get_state()))))
  for want in expected[5:]:
    got = next(resumed)
    for key in want:
      np.testing.assert_array_equal(got[key], want[key])


def test_a_tfds_source_that_is_not_prepared_is_refused_naming_it(tmp_path):
  cf.write_tfds_text(tmp_path / "prepared", [(1, 3)])  # Registers the builder.
  spec = f"tfds:corpus_test_text@{tmp_path / 'empty'}:train"
  with pytest.raises(corpus.CorpusError, match=r"s0: the TFDS source 'tfds:corpus_test_text@"
                                               r".*:train' cannot be read \(CorpusError: it is "
                                               r"not prepared in .*Prepare it first"):
    corpus.resolve(spec, field="text", weight=1.0, where="s0")
  assert not (tmp_path / "empty").exists()  # Nothing was prepared or written.
