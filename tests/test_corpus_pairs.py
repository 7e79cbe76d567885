"""Every trained (input, target) pair of the corpus's rows is a next-token pair of one
document: the invariant itself, checked against the documents' ids computed here.

Each document is words no other document (and no other place in it) holds, and the
vocabulary is built here, word by word, so an (input, target) pair names the document and
the place it comes from, and the ids of a document are known without the product's
tokenizer. A count of targets per document cannot see a shift by one; this can.
"""

import collections
import json

import numpy as np
import pytest

from trainer.data import corpus, lm, packing

LENGTH = 16
BOS, EOS = 1, 2
DOCS = 30


def _lengths():
  """Words per document: 1 (BOS, word, EOS) to 40 (more than two rows of 16)."""
  return [int(n) for n in np.random.default_rng(7).integers(1, 41, size=DOCS)]


def _word(doc: int, place: int) -> str:
  return f"d{doc}p{place}"


@pytest.fixture(scope="module")
def written(tmp_path_factory):
  """Two JSONL files and a Parquet file of the documents, a word-level tokenizer whose ids
  are assigned here (`vocab`), and each document's ids as the model must see them."""
  import pyarrow as pa
  import pyarrow.parquet as pq
  from tokenizers import Tokenizer, models, pre_tokenizers

  root = tmp_path_factory.mktemp("pairs")
  lengths = _lengths()
  vocab = {"<unk>": 0, "<s>": BOS, "</s>": EOS}
  for doc, n in enumerate(lengths):
    for place in range(n):
      vocab[_word(doc, place)] = len(vocab)
  tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
  tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tokenizer.save(str(root / "tokenizer.json"))
  (root / "tokenizer_config.json").write_text(json.dumps(
      {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}))
  texts = [" ".join(_word(doc, p) for p in range(n)) for doc, n in enumerate(lengths)]
  (root / "data").mkdir()
  for name, part in (("a.jsonl", texts[:10]), ("b.jsonl", texts[10:20])):
    (root / "data" / name).write_text("".join(json.dumps({"text": t}) + "\n" for t in part))
  pq.write_table(pa.table({"text": texts[20:]}), root / "data" / "c.parquet",
                 row_group_size=4)
  ids = {doc: [BOS] + [vocab[_word(doc, p)] for p in range(n)] + [EOS]
         for doc, n in enumerate(lengths)}
  return root, ids


def make(written, *, layout, epochs=None, lanes=2, batch_size=4):
  root, _ = written
  source = corpus.resolve(str(root / "data"), field="text", weight=1.0, where="sources[0]")
  return lm.Corpus([source], corpus.Tokenizer(str(root)), length=LENGTH,
                   batch_size=batch_size, lanes=lanes, layout=layout, seed=5, epochs=epochs)


def pair_places(ids: dict[int, list[int]]) -> dict[tuple[int, int], tuple[int, int]]:
  """`(input, target) -> (document, index of the target)` for every next-token pair of every
  document (unique: no two places share a word, and BOS/EOS pair with one word each)."""
  places = {}
  for doc, tokens in ids.items():
    for k in range(1, len(tokens)):
      pair = (tokens[k - 1], tokens[k])
      assert pair not in places
      places[pair] = (doc, k)
  return places


def trained_places(rows, places) -> list[tuple[int, int]]:
  """The (document, target index) of every trained position of `rows`; fails naming the
  first trained pair that is no document's next-token pair."""
  out = []
  for r, row in enumerate(rows):
    weight = np.ones(np.shape(row["targets"]), np.float32)
    if packing.SEGMENT_IDS in row:
      weight = weight * (np.asarray(row[packing.SEGMENT_IDS]) > 0)
    if packing.LOSS_WEIGHTS in row:
      weight = weight * np.asarray(row[packing.LOSS_WEIGHTS])
    for j in np.flatnonzero(weight > 0):
      pair = (int(row["inputs"][j]), int(row["targets"][j]))
      assert pair in places, (f"row {r} position {j}: input {pair[0]} -> target {pair[1]} "
                              f"is no document's next-token pair; row {row}")
      out.append(places[pair])
  return out


def segments_are_runs_of_one_document(row, places) -> None:
  """In a packed row, each segment's pairs are consecutive places of one document."""
  seg = np.asarray(row[packing.SEGMENT_IDS])
  for s in set(seg[seg > 0].tolist()):
    where = [places[(int(row["inputs"][j]), int(row["targets"][j]))]
             for j in np.flatnonzero(seg == s)]
    docs = {d for d, _ in where}
    assert len(docs) == 1, f"segment {s} of {row} mixes documents {docs}"
    ks = [k for _, k in where]
    assert ks == list(range(ks[0], ks[0] + len(ks))), f"segment {s} skips places: {ks}"


@pytest.mark.parametrize("layout", ["packed", "chunked"])
def test_every_trained_pair_of_the_train_stream_is_a_next_token_pair(written, layout):
  """The batches `fit` consumes (endless, two lanes, several epochs' worth)."""
  places = pair_places(written[1])
  stream = make(written, layout=layout)()
  rows = [{k: v[i] for k, v in batch.items()} for batch in (next(stream) for _ in range(60))
          for i in range(4)]
  assert len(trained_places(rows, places)) > 2 * len(places)  # More than two epochs.
  if layout == "packed":
    for row in rows:
      segments_are_runs_of_one_document(row, places)
    packing.check_packed({k: np.stack([r[k] for r in rows]) for k in rows[0]})
    # No pad id is a target of a real position, and a row's last document ends in EOS.
    for row in rows:
      seg = row[packing.SEGMENT_IDS]
      assert (row["targets"][seg > 0] != 0).all()


@pytest.mark.parametrize("layout", ["packed", "chunked"])
def test_each_token_but_a_documents_first_is_a_target_exactly_once_an_epoch(written, layout):
  places = pair_places(written[1])
  c = make(written, layout=layout, epochs=1)
  rows = [row for lane in range(c.lanes) for row in c.lane_rows(lane)]
  counts = collections.Counter(trained_places(rows, places))
  expected = {(doc, k): 1 for doc, tokens in written[1].items() for k in range(1, len(tokens))}
  if layout == "chunked":  # The epoch's last row of each lane is cut at the row's end.
    missing = set(expected) - set(counts)
    assert len(missing) < c.lanes * LENGTH
    expected = {p: 1 for p in expected if p not in missing}
  assert dict(counts) == expected


def test_a_short_document_packs_with_its_last_pair_and_a_long_one_in_pieces():
  """`corpus.pieces` itself: inputs and targets of each piece line up, one token on."""
  ids = np.array([1, 90, 269, 334, 2])
  (piece,) = corpus.pieces(ids, 16)
  np.testing.assert_array_equal(piece["inputs"], ids[:-1])
  np.testing.assert_array_equal(piece["targets"], ids[1:])
  long = np.arange(40)
  out = corpus.pieces(long, 16, weights=np.arange(40) / 40)
  assert [len(p["inputs"]) for p in out] == [16, 16, 7]
  for p in out:
    np.testing.assert_array_equal(p["targets"], p["inputs"] + 1)
    np.testing.assert_array_equal(p[corpus.WEIGHTS], p["targets"] / 40)
