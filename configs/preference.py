r"""Preference optimisation of a language model (examples/preference_lm.py).

    python examples/preference_lm.py --workdir=/tmp/dpo
    python examples/preference_lm.py --config=configs/preference.py:lora --workdir=/tmp/lora_dpo

The model, tokenizer, strategy and LoRA settings are the fine-tuning example's
(`configs/finetune_lm.py`); `config.preference` adds the loss and its reference
(`trainer.preference`), and `config.data.sources` name preference records
(`{prompt, chosen, rejected}`, `trainer.preference.data`).

Variants: `dpo` (DPO's sigmoid loss, a frozen copy as the reference, FSDP), `ipo`,
`simpo`, `orpo` (the same with that loss; SimPO and ORPO use no reference), `lora`
(DPO on rank-8 adapters, the reference the base with the adapters off), `qlora`
(`lora` with the base in NF4) and `sweep` (`dpo` at four values of beta, one member each
of one ensemble program, the best by held-out reward accuracy exported).
"""

import ml_collections

from configs import finetune_lm

VARIANTS = ("dpo", "ipo", "simpo", "orpo", "lora", "qlora", "sweep")


def preference_fields() -> ml_collections.ConfigDict:
  """`config.preference`: the loss, its settings and the reference (TRL 1.16's defaults)."""
  return ml_collections.ConfigDict(dict(
      loss="sigmoid",  # "sigmoid" (DPO), "ipo", "simpo" or "orpo".
      beta=0.1,  # DPO's and IPO's beta, SimPO's beta (TRL CPOConfig's default).
      simpo_gamma=0.5,  # SimPO's target margin gamma.
      orpo_lambda=0.1,  # ORPO's weight of the odds-ratio term (TRL ORPOConfig's beta).
      # "auto" (adapters_off under LoRA, else copy), "copy", "adapters_off", "precomputed".
      reference="auto",
      dropout=False,  # The policy's dropout while training (TRL's disable_dropout=True).
      truncation="keep_start",  # A pair longer than seq_len + 1 tokens: cut, or "refuse".
      prompt_field="prompt",
      chosen_field="chosen",
      rejected_field="rejected",
  ))


def get_config(variant: str = "dpo") -> ml_collections.ConfigDict:
  if variant not in VARIANTS:
    raise ValueError(f"configs/preference.py:{variant}: the variant must be one of "
                     f"{VARIANTS}.")
  config = finetune_lm.get_config(variant if variant in ("lora", "qlora") else "full")
  config.trainer = "trainer.preference:PreferenceTrainer"
  config.preference = preference_fields()
  if variant in ("ipo", "simpo", "orpo"):
    config.preference.loss = {"ipo": "ipo", "simpo": "simpo", "orpo": "orpo"}[variant]
  if variant == "simpo":
    config.preference.beta = 2.0  # The SimPO paper's range (2.0-2.5) for its gamma/beta.
  # Two sequences a pair: half the fine-tune's rows, the same tokens a step.
  config.batch_size = 8
  config.eval_batch_size = 8
  config.num_train_steps = 100
  config.log_every_steps = 25
  config.learning_rate = 5e-5 if variant not in ("lora", "qlora") else 5e-4
  config.schedule.warmup_steps = 10
  if variant == "sweep":  # Members over the 'ensemble' axis, each one's batch over 'data'.
    config.strategy.name = "sharded_ensemble"
    config.strategy.logical_axis_rules = ()
    config.ensemble_size = 0  # The sweep's member count.
    config.strategy.ensemble_mesh_shape = (4, -1)  # A member a group of devices.
    config.sweep.grid.beta = (0.05, 0.1, 0.2, 0.5)
    config.sweep.metric = "rewards/accuracies"
    config.sweep.mode = "max"
  return config
