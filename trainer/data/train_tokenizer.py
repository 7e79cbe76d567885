r"""Trains a byte-level BPE tokenizer on your own corpus: the `tokenizer.json` an LM run reads.

As a command::

    python -m trainer.data.train_tokenizer --files='corpus/*.jsonl.gz' --vocab_size=8192 \
        --out=/tmp/my_tokenizer [--field=text] [--bos='<|bos|>' --eos='<|eos|>'] \
        [--noadd_bos] [--chat_template=chatml|llama3|template.jinja] [--min_frequency=2]

`--files` names the corpus as `config.data.sources` does (paths, globs or directories of
`.jsonl`, `.jsonl.gz`, `.parquet` or `.array_record` files, comma-separated), and each
record's `--field` is a document. `tokenizers`' BPE trainer learns the merges over bytes
(GPT-2's byte-level alphabet, so any text encodes and nothing is unknown) with BOS and
EOS as special tokens. `--out` receives `tokenizer.json` and a `tokenizer_config.json`
that names them (`add_bos_token`, and the chat template with its special tokens when
`--chat_template` names one), as a Hugging Face model directory holds them; an LM run
takes the directory::

    python examples/transformer_lm.py --config.data.tokenizer=/tmp/my_tokenizer \
        --config.model.vocab_size=8192 --config.data.sources='("corpus/*.jsonl.gz",)' ...

`--vocab_size` counts the special tokens; it must exceed the 256 byte tokens and them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

from trainer.data.records import CorpusError

#: Chat templates by name, as their model families publish them, and the special tokens
#: each writes (added to the vocabulary). A path to a Jinja2 file is taken as it is.
CHAT_TEMPLATES = {
    "chatml": (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
        "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}"
        "{{ '<|im_start|>assistant\\n' }}{% endif %}",
        ("<|im_start|>", "<|im_end|>")),
    "llama3": (
        "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + "
        "message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + "
        "'<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}"
        "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}",
        ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")),
}
BYTES = 256  # The byte-level alphabet every vocabulary starts from.


def chat_template(name: str) -> tuple[str, tuple[str, ...]]:
  """`(template, its special tokens)` for a name of `CHAT_TEMPLATES` or a Jinja2 file.

  Raises:
    CorpusError: neither a known name nor a readable file.
  """
  if name in CHAT_TEMPLATES:
    return CHAT_TEMPLATES[name]
  if os.path.isfile(os.path.expanduser(name)):
    with open(os.path.expanduser(name), encoding="utf-8") as f:
      return f.read(), ()
  raise CorpusError(f"--chat_template={name!r} is neither one of {sorted(CHAT_TEMPLATES)} nor "
                    f"a Jinja2 file.")


def train_tokenizer(documents: Iterable[str], out: str, *, vocab_size: int,
                    bos: str = "<|bos|>", eos: str = "<|eos|>", add_bos: bool = True,
                    template: str = "", min_frequency: int = 2):
  """Trains a byte-level BPE tokenizer on `documents` and writes it to `out`
  (`tokenizer.json`, `tokenizer_config.json`); returns the `tokenizers.Tokenizer`.

  Args:
    documents: the texts to learn merges from.
    out: the directory to write (made if missing).
    vocab_size: tokens in all, the special ones included.
    bos, eos: the special tokens that bracket a document (`config.data.add_bos`/`add_eos`
      follow the written `tokenizer_config.json`).
    add_bos: whether a document starts with BOS (`add_bos_token`, and the post-processor
      that `transformers`' `AutoTokenizer` applies).
    template: "" (none), a name of `CHAT_TEMPLATES`, or a Jinja2 file.
    min_frequency: the fewest occurrences a merge needs.

  Raises:
    CorpusError: a vocabulary too small for the bytes and the special tokens, no
      documents, or an unknown chat template; before anything is written.
  """
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

  text, chat_specials = chat_template(template) if template else ("", ())
  specials = list(dict.fromkeys([bos, eos, *chat_specials]))
  if not isinstance(vocab_size, int) or vocab_size <= BYTES + len(specials):
    raise CorpusError(f"--vocab_size={vocab_size!r} must exceed the {BYTES} byte tokens and "
                      f"the {len(specials)} special tokens {specials}.")
  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  count = [0]

  def counted():
    for doc in documents:
      count[0] += 1
      yield doc

  tokenizer.train_from_iterator(counted(), trainers.BpeTrainer(
      vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=specials,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
  if not count[0]:
    raise CorpusError("no documents to train the tokenizer on: the files hold no record with "
                      "the text field.")
  if add_bos:  # In the post-processor too, as Llama's: `AutoTokenizer` adds it from there.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
        special_tokens=[(bos, tokenizer.token_to_id(bos))])
  os.makedirs(out, exist_ok=True)
  tokenizer.save(os.path.join(out, "tokenizer.json"))
  settings = {"bos_token": bos, "eos_token": eos, "add_bos_token": add_bos,
              "tokenizer_class": "PreTrainedTokenizerFast"}
  if text:
    settings["chat_template"] = text
  with open(os.path.join(out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
    json.dump(settings, f, indent=1)
  return tokenizer, count[0]


def _define_flags():
  from absl import flags
  flags.DEFINE_string("files", None, "The corpus: paths, globs or directories, comma-separated.")
  flags.DEFINE_string("field", "text", "The JSON key or Parquet column of each document.")
  flags.DEFINE_integer("vocab_size", None, "Tokens in all, the special tokens included.")
  flags.DEFINE_string("out", None, "The directory to write tokenizer.json and "
                      "tokenizer_config.json to.")
  flags.DEFINE_string("bos", "<|bos|>", "The beginning-of-document token.")
  flags.DEFINE_string("eos", "<|eos|>", "The end-of-document token.")
  flags.DEFINE_boolean("add_bos", True, "Whether each document starts with BOS.")
  flags.DEFINE_string("chat_template", "", f"A chat template: one of {sorted(CHAT_TEMPLATES)} "
                      f"or a Jinja2 file (empty: none).")
  flags.DEFINE_integer("min_frequency", 2, "The fewest occurrences a merge needs.")
  flags.mark_flags_as_required(["files", "vocab_size", "out"])


def main(argv):

  from absl import flags

  from trainer.data import corpus, records
  if len(argv) > 1:
    raise SystemExit(f"Unexpected arguments: {argv[1:]}")
  f = flags.FLAGS
  source = corpus.resolve(f.files, field=f.field, weight=1.0, where="--files")
  tokenizer, documents = train_tokenizer(
      records.texts(source.files, f.field), f.out, vocab_size=f.vocab_size, bos=f.bos,
      eos=f.eos, add_bos=f.add_bos, template=f.chat_template,
      min_frequency=f.min_frequency)
  print(f"wrote a {tokenizer.get_vocab_size()}-token byte-level BPE tokenizer trained on "
        f"{documents} documents of {len(source.files)} file(s) to {f.out} (tokenizer.json, "
        f"tokenizer_config.json)")


if __name__ == "__main__":
  _define_flags()
  from trainer import config as config_lib
  config_lib.run(main, flags_parser=None)
