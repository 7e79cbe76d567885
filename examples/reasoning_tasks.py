"""Tasks from `reasoning_gym` (the `reasoning` extra) as RL prompt records, scored by the
dataset's own `score_answer` (`configs/rl.py:reasoning`).

`write_task` generates a dataset offline (`reasoning_gym.create_dataset(name, size=...,
seed=..., **settings)`) and writes each entry as a record: its `question` as the prompt,
its `answer`, and the whole `entry` (question, answer, metadata), which the reward gets
as a keyword argument, as any record field reaches a reward (`trainer.rl.rewards`). A
character-level tokenizer over printable ASCII goes beside it. `score_answer` finds the
entry's dataset by its metadata's `source_dataset` and asks it to score each completion.
"""

from __future__ import annotations

import json
import os
import string

BOS, EOS = "<s>", "</s>"


def write_task(directory: str, name: str, *, size: int, seed: int, held_out: int = 0,
               **settings) -> tuple[str, str, str]:
  """(tokenizer file, train records, held-out records) of `size` + `held_out` entries of
  the dataset `name`."""
  import reasoning_gym
  from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

  os.makedirs(directory, exist_ok=True)
  characters = string.printable.replace("\x0b", "").replace("\x0c", "")
  vocab = {BOS: 0, EOS: 1, **{c: i + 2 for i, c in enumerate(characters)}}
  tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=EOS))
  tokenizer.add_special_tokens([BOS, EOS])
  tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
  tokenizer.decoder = decoders.Fuse()
  tokenizer.post_processor = processors.TemplateProcessing(
      single=f"{BOS} $A", special_tokens=[(BOS, vocab[BOS])])
  tokenizer_path = os.path.join(directory, "tokenizer.json")
  tokenizer.save(tokenizer_path)
  with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
    json.dump({"bos_token": BOS, "eos_token": EOS, "add_bos_token": True}, f)
  dataset = reasoning_gym.create_dataset(name, size=size + held_out, seed=seed, **settings)
  paths = [os.path.join(directory, f"{part}.jsonl") for part in ("train", "held_out")]
  with open(paths[0], "w") as train, open(paths[1], "w") as rest:
    for i, entry in enumerate(dataset):
      record = {"prompt": entry["question"], "answer": entry["answer"], "entry": entry}
      (train if i < size else rest).write(json.dumps(record, default=str) + "\n")
  return tokenizer_path, paths[0], paths[1]


def score_answer(completions, entry, **kwargs):
  """Each completion scored by its entry's dataset (`score_answer`, in [0, 1])."""
  import reasoning_gym
  return [float(reasoning_gym.get_score_answer_fn(e["metadata"]["source_dataset"])(
      answer=c.strip(), entry=e)) for c, e in zip(completions, entry, strict=True)]
