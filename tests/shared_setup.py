"""A LoRA sweep over one frozen base loaded from a `transformers` Llama (the tests of frozen
parts held once, `tests/test_shared_frozen.py` and `tests/shared_resume_run.py`)."""

import ml_collections
import preference_files as pf
from small_configs import tiny_lm_config

from trainer.language_model import synthetic_token_batches

TARGETS = (".*self_attn/[qo]_proj/kernel", ".*mlp/down_proj/kernel")
RATES = (1e-2, 1e-1)
SWEEP = {"strategy.name": "sharded_ensemble", "strategy.logical_axis_rules": (),
         "strategy.mesh_shape": (), "strategy.mesh_axes": (), "ensemble_size": 0,
         "strategy.ensemble_mesh_shape": (2, -1)}  # Each member's rows over 4 devices.


def lora_config(base, *, rates=RATES, **overrides):
  from trainer.interop import hf
  config = tiny_lm_config("data_parallel", learning_rate=RATES[0], optimizer="sgd")
  config.model = ml_collections.ConfigDict(hf.model_fields(str(base)))
  config.init_from.path = str(base)
  config.lora.update(rank=2, alpha=4.0, targets=TARGETS)
  config.schedule.warmup_steps = 0
  if rates:
    config.update_from_flattened_dict(SWEEP)
    config.sweep.grid.learning_rate = rates
  config.update_from_flattened_dict(overrides)
  return config


def stream(start):
  return synthetic_token_batches(0, 16, 16, pf.VOCAB, start)
