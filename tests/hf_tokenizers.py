"""Tokenizer directories as `transformers` itself writes them (`save_pretrained`): a
GPT-2-style, a Llama-3-style and a Qwen-style byte-level BPE, each trained by `tokenizers`
on a few words and saved through `PreTrainedTokenizerFast`.

- `gpt2`: `<|endoftext|>` is BOS and EOS; no post-processor adds BOS; no chat template.
- `llama3`: its `tokenizer.json`'s post-processor (`TemplateProcessing`) puts
  `<|begin_of_text|>` before every text, and `tokenizer_config.json` has no
  `add_bos_token`, as Llama 3's; a Llama-3-shaped chat template.
- `qwen`: no BOS; ChatML (`<|im_start|>` ... `<|im_end|>`), EOS `<|im_end|>`.

`transformers` 5 writes each chat template to `chat_template.jinja`, not into
`tokenizer_config.json`.
"""

from __future__ import annotations

import pathlib

import preference_files as pf

KINDS = ("gpt2", "llama3", "qwen")
QWEN_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] "
                 "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}"
                 "{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = {"gpt2": ["<|endoftext|>"], "llama3": pf.SPECIALS,
            "qwen": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]}


def save(kind: str, directory: pathlib.Path) -> pathlib.Path:
  """`kind`'s tokenizer saved by `save_pretrained` into `directory`."""
  import transformers
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  lines = [" ".join(pf.WORDS[i:i + 7]) for i in range(len(pf.WORDS))]
  tokenizer.train_from_iterator(lines * 10, trainers.BpeTrainer(
      vocab_size=300, special_tokens=SPECIALS[kind],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
  if kind == "gpt2":
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
        unk_token="<|endoftext|>")
  elif kind == "llama3":
    bos = tokenizer.token_to_id(pf.BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{pf.BOS} $A", pair=f"{pf.BOS} $A {pf.BOS} $B", special_tokens=[(pf.BOS, bos)])
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=pf.BOS, eos_token=pf.EOS, pad_token=pf.PAD)
    fast.chat_template = pf.TEMPLATE
  else:
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = QWEN_TEMPLATE
  fast.save_pretrained(str(directory))
  return directory


def save_with_model(kind: str, directory: pathlib.Path) -> pathlib.Path:
  """`kind`'s tokenizer beside a tiny random model (GPT-2 for `gpt2`, else Llama) that
  TRL's trainers can load."""
  pf.save_model("gpt2" if kind == "gpt2" else "llama", directory)
  for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
    (directory / name).unlink(missing_ok=True)  # `save_model`'s own; replaced below.
  return save(kind, directory)
