"""Configs shrunk for tests; importing this sets up no devices (subprocess drivers use it too)."""

import ml_collections

from configs import lm


def tiny_lm_config(layout: str = "data_parallel", **overrides) -> ml_collections.ConfigDict:
  """configs/lm.py:<layout> with a 2-layer (a pipeline layout: its own count), 32-wide
  transformer on 16-token sequences."""
  config = lm.get_config(layout)
  layers = lm.PIPELINES.get(layout, {}).get("num_layers", 2)
  config.model.update(num_layers=layers, embed_dim=32, num_heads=8, head_dim=4, mlp_dim=64,
                      vocab_size=32, max_len=16)
  config.seq_len = 16
  config.batch_size = 16
  config.eval_batch_size = 16
  config.log_every_steps = 1000
  config.update_from_flattened_dict(overrides)
  return config
