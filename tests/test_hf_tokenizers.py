"""Tokenizer directories that `transformers` 5's `save_pretrained` writes (GPT-2-, Llama-3-
and Qwen-style, `hf_tokenizers`) tokenize here as `AutoTokenizer` tokenizes them: BOS where
the post-processor adds it, the chat template read from `chat_template.jinja`; documents,
RL prompts and preference pairs alike, the pairs as TRL 1.16's `DPOTrainer` makes them."""

import json

import hf_tokenizers
import numpy as np
import preference_files as pf
import pytest

transformers = pytest.importorskip("transformers")

from trainer.data.corpus import Tokenizer  # noqa: E402

TEXTS = ["the cat sat", " on a mat", "red apples:", "quick brown foxes jump over lazy hens"]
CHATS = [[{"role": "user", "content": "the cat sat"}],
         [{"role": "user", "content": "rain falls"},
          {"role": "assistant", "content": "softly at night"},
          {"role": "user", "content": "green pears"}]]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  root = tmp_path_factory.mktemp("hf_tokenizers")
  return {kind: hf_tokenizers.save_with_model(kind, root / kind)
          for kind in hf_tokenizers.KINDS}


def test_save_pretrained_writes_the_files_the_tokenizer_is_read_from(saved):
  """The layout these tests stand on: the chat template in `chat_template.jinja`, and no
  `add_bos_token` even where the post-processor adds BOS."""
  for kind, directory in saved.items():
    settings = json.loads((directory / "tokenizer_config.json").read_text())
    assert "chat_template" not in settings and "add_bos_token" not in settings, kind
    assert (directory / "chat_template.jinja").is_file() == (kind != "gpt2"), kind


@pytest.mark.parametrize("kind", hf_tokenizers.KINDS)
def test_texts_and_documents_tokenize_as_autotokenizer_does(saved, kind):
  ours = Tokenizer(str(saved[kind]))
  theirs = transformers.AutoTokenizer.from_pretrained(str(saved[kind]))
  for text in TEXTS:
    want = theirs(text)["input_ids"]
    assert ours.encode_text(text) == want, (kind, text)
    document = ours(text).tolist()  # A corpus document: the same, and EOS after it.
    assert document == want + [theirs.eos_token_id], (kind, text)
  assert (ours.add_bos, ours.bos_id) == ((True, theirs.bos_token_id) if kind == "llama3"
                                         else (False, ours.bos_id))


@pytest.mark.parametrize("kind", ["llama3", "qwen"])
def test_the_chat_template_is_read_from_chat_template_jinja(saved, kind):
  from trainer.rl.data import PromptEncoder
  ours = Tokenizer(str(saved[kind]))
  theirs = transformers.AutoTokenizer.from_pretrained(str(saved[kind]))
  prompts = PromptEncoder(ours, length=128)
  for messages in CHATS:
    for generation in (False, True):
      assert ours.chat_template().render(messages, add_generation_prompt=generation) == (
          theirs.apply_chat_template(messages, tokenize=False,
                                     add_generation_prompt=generation)), (kind, generation)
    want = theirs.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
    assert prompts.ids(messages) == list(want), kind  # An RL prompt.
  for text in TEXTS:
    assert prompts.ids(text) == theirs(text)["input_ids"], kind


def _trl_ids(directory, records, tmp_path):
  from datasets import Dataset
  from trl import DPOConfig, DPOTrainer
  dpo = DPOTrainer(
      model=transformers.AutoModelForCausalLM.from_pretrained(str(directory)),
      args=DPOConfig(output_dir=str(tmp_path / "trl"), report_to="none", use_cpu=True,
                     bf16=False, per_device_train_batch_size=4, max_length=129),
      train_dataset=Dataset.from_list(records),
      processing_class=transformers.AutoTokenizer.from_pretrained(str(directory)))
  rows = [dpo.train_dataset[i] for i in range(len(records))]
  return [(r["prompt_ids"], r["chosen_ids"], r["rejected_ids"]) for r in rows]


@pytest.mark.parametrize("kind,chat", [("gpt2", False), ("llama3", False), ("llama3", True),
                                       ("qwen", False), ("qwen", True)])
def test_preference_pairs_tokenize_as_trls_dpo_trainer(saved, kind, chat, tmp_path):
  """32 records each: text (`tokenizer(prompt)`, BOS from the post-processor) and chat."""
  pytest.importorskip("trl")
  from trainer.preference.data import PairEncoder
  records = pf.chat_pairs(32) if chat else pf.text_pairs(32)
  encoder = PairEncoder(Tokenizer(str(saved[kind])), length=128)
  ours = [tuple(map(list, encoder.tokenize(r)[1])) for r in records]
  theirs = [tuple(map(list, t)) for t in _trl_ids(saved[kind], records, tmp_path)]
  differ = [i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b]
  assert differ == [], f"{len(differ)} of 32 records differ, the first: {differ[:1]}"
  assert np.mean([len(p) for p, _, _ in ours]) > 1
