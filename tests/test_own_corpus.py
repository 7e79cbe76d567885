"""A corpus of one's own: a tokenizer trained on it (`trainer.data.train_tokenizer`), and
sources that each name their text field."""

import json

import numpy as np
import pytest

from configs import lm as lm_config
from trainer.data import corpus, lm, records
from trainer.data.train_tokenizer import CorpusError, train_tokenizer

TEXTS = [f"Document {i} says the quick brown fox jumps over {i} lazy dogs." for i in range(50)]


def test_a_trained_tokenizer_brackets_documents_and_encodes_any_text(tmp_path):
  tokenizer, documents = train_tokenizer(iter(TEXTS), str(tmp_path), vocab_size=300)
  assert documents == len(TEXTS) and tokenizer.get_vocab_size() == 300
  ours = corpus.Tokenizer(str(tmp_path))  # What an LM run reads: BOS and EOS named.
  ids = ours("naïve ☃ text")
  assert ids[0] == ours.bos_id and ids[-1] == ours.eos_id
  assert ours.tokenizer.decode(ids.tolist(), skip_special_tokens=True) == "naïve ☃ text"


def test_a_chat_template_is_written_with_its_special_tokens(tmp_path):
  train_tokenizer(iter(TEXTS), str(tmp_path), vocab_size=320, template="chatml", add_bos=False)
  settings = json.loads((tmp_path / "tokenizer_config.json").read_text())
  assert "<|im_start|>" in settings["chat_template"]
  ours = corpus.Tokenizer(str(tmp_path))
  messages = [{"role": "user", "content": "Say the fox."},
              {"role": "assistant", "content": "The quick brown fox."}]
  ids, weights = ours.encode_chat(messages)
  start = ours.tokenizer.token_to_id("<|im_start|>")
  assert start is not None and list(ids).count(start) == 2  # One token, once a turn.
  trained = ours.tokenizer.decode(ids[weights > 0].tolist(), skip_special_tokens=False)
  assert trained.startswith("The quick brown fox.") and trained.endswith("<|im_end|>\n")


@pytest.mark.parametrize("kwargs, message", [
    (dict(vocab_size=200), r"--vocab_size=200 must exceed the 256 byte tokens and the 2"),
    (dict(vocab_size=400, template="vicuna"), r"--chat_template='vicuna' is neither one of"),
])
def test_a_tokenizer_that_cannot_be_trained_is_refused_before_writing(tmp_path, kwargs, message):
  with pytest.raises(CorpusError, match=message):
    train_tokenizer(iter(TEXTS), str(tmp_path / "out"), **kwargs)
  assert not (tmp_path / "out").exists()


def _write_sources(tmp_path):
  import pyarrow as pa
  import pyarrow.parquet as pq
  (tmp_path / "web.jsonl").write_text(
      "".join(json.dumps({"text": t}) + "\n" for t in TEXTS[:25]))
  pq.write_table(pa.table({"content": TEXTS[25:]}), tmp_path / "code.parquet")
  train_tokenizer(records.texts([str(tmp_path / "web.jsonl")], "text"),
                  str(tmp_path / "tok"), vocab_size=300)


def _config(tmp_path, **data):
  config = lm_config.get_config()
  config.model.vocab_size = 300
  config.seq_len, config.batch_size = 16, 4
  config.data.update(sources=(str(tmp_path / "web.jsonl"), str(tmp_path / "code.parquet")),
                     tokenizer=str(tmp_path / "tok"), workers=0, **data)
  return config


def test_each_source_names_its_text_field(tmp_path):
  _write_sources(tmp_path)
  with pytest.raises(ValueError, match=r"no string column 'text'"):
    lm.check_config(_config(tmp_path))  # One field for both: the Parquet file has none.
  config = _config(tmp_path, text_fields=("text", "content"), weights=(0.5, 0.5))
  sources = lm.check_config(config)
  assert [s.field for s in sources] == ["text", "content"]
  c = lm.from_config(config, epochs=1)
  tok = c.tokenizer
  seen = set()
  for lane in range(c.lanes):
    for row in c.lane_rows(lane):
      real = row["segment_ids"] > 0
      seen.update(tok.tokenizer.decode(row["inputs"][real].tolist()).split("Document ")[1:])
  numbers = {int(s.split()[0]) for s in seen if s.split() and s.split()[0].isdigit()}
  assert numbers & set(range(25)) and numbers & set(range(25, 50))  # Both sources trained.
  with pytest.raises(ValueError, match=r"config.data.text_fields=\('text',\) must name one "
                                       r"field per source \(2 sources\)"):
    lm.check_config(_config(tmp_path, text_fields=("text",)))


def test_the_text_of_every_format_is_read_for_a_tokenizer(tmp_path):
  _write_sources(tmp_path)
  texts = list(records.texts([str(tmp_path / "web.jsonl"), str(tmp_path / "code.parquet")],
                             "content"))
  assert texts == TEXTS[25:]  # The JSONL records have no `content`: left out.
  assert np.all([isinstance(t, str) for t in texts])
