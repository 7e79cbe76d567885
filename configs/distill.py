r"""On-policy distillation of a language model (examples/distill_lm.py).

    python examples/distill_lm.py --workdir=/tmp/distill
    python examples/distill_lm.py --config=configs/distill.py:gkd --workdir=/tmp/gkd

`config.distill` holds the teacher, the divergence (`beta`, `temperature`), GKD's
`lmbda` and the completions' sizes (`trainer.distill`); `config.data.sources` name prompt
records (`{prompt: ..., completion: ...}`, `trainer.distill.data`). The student's model,
tokenizer, strategy and LoRA settings are the fine-tuning example's
(`configs/finetune_lm.py`).

Variants: `onpolicy` (the student's own samples every step, the reverse KL: TRL 1.16
DistillationTrainer's defaults), `gkd` (GKD: half the batches the records' completions,
the JSD at beta 0.5) and `lora` (`onpolicy` on rank-8 adapters).
"""

import ml_collections

from configs import finetune_lm

VARIANTS = ("onpolicy", "gkd", "lora")


def distill_fields() -> ml_collections.ConfigDict:
  """`config.distill`: the teacher and the loss (TRL 1.16's defaults)."""
  return ml_collections.ConfigDict(dict(
      # A Hugging Face model directory or a run's workdir, of the student's vocabulary.
      teacher="",
      teacher_dtype="",  # "": the weights' own; "nf4" or "int8": stored as QLoRA's base.
      teacher_block_size=64,  # A quantized teacher's values per scale (QLoRA's 64).
      beta=1.0,  # 0: forward KL(teacher || student); 1: reverse KL; between: generalized JSD.
      temperature=1.0,  # Of both distributions in the loss, and of the student's sampling.
      lmbda=1.0,  # The share of batches the student samples (GKD's; 1: always, TRL's).
      max_prompt_length=32,
      max_completion_length=32,
      top_k=0,
      top_p=1.0,
      prompt_field="prompt",
      completion_field="completion",
  ))


def get_config(variant: str = "onpolicy") -> ml_collections.ConfigDict:
  if variant not in VARIANTS:
    raise ValueError(f"configs/distill.py:{variant}: the variant must be one of {VARIANTS}.")
  config = finetune_lm.get_config("lora" if variant == "lora" else "full")
  config.trainer = "trainer.distill:DistillationTrainer"
  config.distill = distill_fields()
  config.batch_size = 16
  config.eval_batch_size = 16
  config.num_train_steps = 100
  config.log_every_steps = 25
  config.learning_rate = 1e-3 if variant != "lora" else 3e-3
  config.schedule.warmup_steps = 5
  config.data.bad_records = "skip"  # Docs prompts that tokenize past the row: counted.
  # The teacher the example trains first when config.distill.teacher is empty: a GPT-2
  # twice the student's width and depth, on the same text (examples/distill_lm.py).
  config.teacher = ml_collections.ConfigDict(dict(
      steps=300, num_layers=4, embed_dim=128, num_heads=4, mlp_dim=512, learning_rate=1e-3))
  if variant == "gkd":
    config.distill.update(lmbda=0.5, beta=0.5)
  return config
