"""The RL example's tasks: their prompts, tokenizer and reward functions
(`examples/rl_lm.py`; `configs/rl.py` names the rewards by import path).

- addition: `"<a>+<b>="` for every pair of digits whose sum is one digit (55 prompts),
  over a character vocabulary; the reward is 1 when the completion is the sum.
- docs: a docs paragraph's opening words; the reward is 1 when the completion
  mentions training (any of a few words), a task a fine-tuned model can learn fast.
"""

import json
import os

#: The addition task's characters, each a token; BOS and EOS around them.
CHARACTERS = list("0123456789+=")
BOS, EOS = "<s>", "</s>"
TRAINING_WORDS = ("train", "step", "model", "loss")


def addition_prompts() -> list[str]:
  return [f"{a}+{b}=" for a in range(10) for b in range(10) if a + b < 10]


def write_addition(directory: str) -> tuple[str, str]:
  """The prompts as JSONL and a character-level tokenizer (`tokenizer.json`, and its
  `tokenizer_config.json`: BOS before each prompt): (prompts file, tokenizer file)."""
  from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

  os.makedirs(directory, exist_ok=True)
  vocab = {BOS: 0, EOS: 1, **{c: i + 2 for i, c in enumerate(CHARACTERS)}}
  tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=EOS))
  tokenizer.add_special_tokens([BOS, EOS])
  tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
  tokenizer.decoder = decoders.Fuse()
  tokenizer.post_processor = processors.TemplateProcessing(  # BOS, as `AutoTokenizer` adds it.
      single=f"{BOS} $A", special_tokens=[(BOS, vocab[BOS])])
  tokenizer_path = os.path.join(directory, "tokenizer.json")
  tokenizer.save(tokenizer_path)
  with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
    json.dump({"bos_token": BOS, "eos_token": EOS, "add_bos_token": True}, f)
  prompts = os.path.join(directory, "prompts.jsonl")
  with open(prompts, "w") as f:
    for prompt in addition_prompts():
      f.write(json.dumps({"prompt": prompt}) + "\n")
  return prompts, tokenizer_path


def correct_sum(*, prompts, completions, **_):
  """1.0 where the completion is the prompt's sum (`"3+4="` -> `"7"`), else 0.0."""
  out = []
  for prompt, completion in zip(prompts, completions, strict=True):
    a, b = prompt.rstrip("=").split("+")
    out.append(1.0 if completion.strip() == str(int(a) + int(b)) else 0.0)
  return out


def mentions_training(*, completions, **_):
  """1.0 where the completion holds one of `TRAINING_WORDS`, else 0.0."""
  return [1.0 if any(w in c.lower() for w in TRAINING_WORDS) else 0.0 for c in completions]
