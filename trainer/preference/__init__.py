"""Preference optimisation (DPO, IPO, SimPO, ORPO) of a language model: a part of its own.

- `trainer.preference.trainer`: `PreferenceTrainer`, a `LanguageModelTrainer` whose
  batches are preference pairs and whose loss is `config.preference.loss`;
- `trainer.preference.losses`: each loss as a function of per-sequence log-probs;
- `trainer.preference.data`: `{prompt, chosen, rejected}` records (text or chat) as rows,
  tokenized as TRL's DPOTrainer does, through the corpus pipeline;
- `trainer.preference.reference`: the reference policy (a frozen copy, the base with the
  LoRA adapters off, or log-probs computed before training).

`configs/preference.py` holds the fields; `examples/preference_lm.py` runs it.
"""

from trainer.preference.data import example_batch
from trainer.preference.trainer import PairOutputs, Preference, PreferenceTrainer

__all__ = ["PairOutputs", "Preference", "PreferenceTrainer", "example_batch"]
