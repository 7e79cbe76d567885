"""The distillation tests' models and config: tiny random `transformers` teachers and
students sharing one tokenizer (`preference_files`), and `configs/distill.py` over them."""

import pathlib

import ml_collections
import preference_files as pf


def write_records(directory: pathlib.Path, count: int = 64, held_out: int = 16
                  ) -> tuple[str, str]:
  """Prompt and completion records of a few words (a pair's prompt and chosen response):
  the train and held-out JSONL files."""
  records = [{"prompt": p["prompt"], "completion": p["chosen"]} for p in pf.text_pairs(count)]
  train = pf.write_jsonl(directory / "train.jsonl", records[held_out:])
  held = pf.write_jsonl(directory / "held.jsonl", records[:held_out])
  return str(train), str(held)


def save_models(root: pathlib.Path) -> pathlib.Path:
  """A Llama teacher (wider, 3 layers) and Llama and Qwen2 students in `root`, their
  weights jittered far from a fresh init's (so that their distributions are peaked and
  far apart: forward and reverse KL differ)."""
  pf.save_model("llama", root / "teacher", seed=1, hidden=48, layers=3, jitter=0.3)
  pf.save_model("llama", root / "llama", seed=2, jitter=0.2)
  pf.save_model("qwen2", root / "qwen2", seed=3, jitter=0.2)
  return root


def config(root: pathlib.Path, student: str = "llama", layout: str = "single_device",
           **overrides) -> ml_collections.ConfigDict:
  """`configs/distill.py:onpolicy` over the tiny models, 8 rows of 24 + 12 tokens."""
  from configs import distill, lm
  from trainer.interop import hf
  config = distill.get_config("onpolicy")
  config.model = ml_collections.ConfigDict(hf.model_fields(str(root / student)))
  config.init_from.path = str(root / student)
  config.distill.update(teacher=str(root / "teacher"), max_prompt_length=24,
                        max_completion_length=12)
  train, held = write_records(root / "records")
  config.data.update(sources=(train,), eval_sources=(held,), workers=0, lanes=1,
                     tokenizer=str(root / student / "tokenizer.json"))
  config.update(seq_len=36, batch_size=8, eval_batch_size=8, num_train_steps=4,
                log_every_steps=1000)
  config.schedule.warmup_steps = 0
  if layout == "single_device":
    config.strategy.name = "single_device"
  else:
    shape, axes, rules = lm.LAYOUTS[layout]
    config.strategy.update(name="sharded_data_parallel", mesh_shape=shape, mesh_axes=axes,
                           logical_axis_rules=rules)
  config.update_from_flattened_dict(overrides)
  return config
