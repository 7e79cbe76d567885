"""Preference records and a tokenizer the preference tests write: text and chat pairs, a
byte-level BPE with a chat template (as a Hugging Face model directory holds it), and tiny
random `transformers` Llama and GPT-2 models beside it. Importing this imports neither
torch nor transformers."""

from __future__ import annotations

import json
import pathlib

BOS, EOS, PAD = "<|begin_of_text|>", "<|eot_id|>", "<|pad|>"
SPECIALS = [BOS, EOS, "<|start_header_id|>", "<|end_header_id|>", PAD]
#: A Llama-3-shaped chat template (its own BOS, a header per turn, EOT after each).
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + "
            "'<|end_header_id|>\n\n' + m['content'] + '<|eot_id|>' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>"
            "\n\n' }}{% endif %}")
VOCAB = 320  # The model's; the tokenizer holds fewer.
WORDS = ("the cat sat on a mat while dogs ran past quick brown foxes jump over lazy hens "
         "red green blue apples pears grow in sunny fields rain falls softly at night").split()


def write_tokenizer(directory: pathlib.Path, *, add_bos: bool) -> pathlib.Path:
  """A byte-level BPE `tokenizer.json` (BOS prepended by its post-processor when `add_bos`,
  as a Llama tokenizer does) and a `tokenizer_config.json` saying the same, with the chat
  template."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  lines = [" ".join(WORDS[i:i + 7]) for i in range(len(WORDS))]
  tokenizer.train_from_iterator(lines * 10, trainers.BpeTrainer(
      vocab_size=300, special_tokens=SPECIALS,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
  if add_bos:
    bos = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos)])
  directory.mkdir(parents=True, exist_ok=True)
  tokenizer.save(str(directory / "tokenizer.json"))
  (directory / "tokenizer_config.json").write_text(json.dumps({
      "bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "add_bos_token": add_bos,
      "chat_template": TEMPLATE, "tokenizer_class": "PreTrainedTokenizerFast"}))
  return directory


def sentence(rng, n: int) -> str:
  return " ".join(WORDS[int(i)] for i in rng.integers(0, len(WORDS), n))


def text_pairs(count: int, seed: int = 0) -> list[dict]:
  """`{prompt, chosen, rejected}` strings of a few words each, of different lengths."""
  import numpy as np
  rng = np.random.default_rng(seed)
  return [{"prompt": sentence(rng, int(rng.integers(2, 6))) + ":",
           "chosen": " " + sentence(rng, int(rng.integers(1, 7))),
           "rejected": " " + sentence(rng, int(rng.integers(1, 7)))} for _ in range(count)]


def chat_pairs(count: int, seed: int = 1) -> list[dict]:
  """TRL's conversational form: a prompt of user turns, a chosen and a rejected assistant
  turn."""
  return [{"prompt": [{"role": "user", "content": p["prompt"]}],
           "chosen": [{"role": "assistant", "content": p["chosen"].strip()}],
           "rejected": [{"role": "assistant", "content": p["rejected"].strip()}]}
          for p in text_pairs(count, seed)]


def write_jsonl(path: pathlib.Path, records: list[dict], lines: list[str] = ()) -> pathlib.Path:
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text("".join(json.dumps(r) + "\n" for r in records)
                  + "".join(line + "\n" for line in lines))
  return path


def save_model(family: str, directory: pathlib.Path, *, seed: int = 0, hidden: int = 32,
               layers: int = 2, jitter: float = 0.02):
  """A tiny random `transformers` causal LM of `family` ("llama", "qwen2" or "gpt2") of
  width `hidden` and `layers` layers, its weights jittered (normal noise of std `jitter`)
  so that biases and norm scales matter, saved with the tokenizer's files beside it;
  returns the model in eval mode."""
  import torch
  import transformers

  torch.manual_seed(seed)
  if family in ("llama", "qwen2"):
    kind = transformers.LlamaConfig if family == "llama" else transformers.Qwen2Config
    config = kind(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=128, tie_word_embeddings=False)
  else:
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=hidden, n_layer=layers,
                                     n_head=4, n_positions=128)
  model = transformers.AutoModelForCausalLM.from_config(config).eval()
  with torch.no_grad():
    for p in model.parameters():
      p.add_(torch.randn_like(p) * jitter)
  model.save_pretrained(str(directory))
  write_tokenizer(directory, add_bos=family != "gpt2")
  return model
