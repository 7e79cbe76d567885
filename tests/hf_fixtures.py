"""Tiny random Hugging Face models for the interop tests (`test_hf_interop.py`,
`test_hf_families.py`, `test_moe.py`): built with `transformers` offline, saved with
`save_pretrained`, loaded here through `config.init_from.path`, and both libraries' outputs
for the same tokens. Importing this imports neither torch nor transformers: the tests
`importorskip` them first.
"""

import jax
import ml_collections
import numpy as np
from small_configs import tiny_lm_config

from trainer.interop import hf

VOCAB, LENGTH = 64, 16
#: The bound for float32 logits of the same weights in two libraries: far above what
#: reordered float32 sums of these widths (32, 48) can move a logit (~1e-6).
ATOL = 1e-4


def tokens(rows: int) -> np.ndarray:
  """`rows` sequences of `LENGTH` token ids, the same in every test."""
  return np.random.default_rng(0).integers(0, VOCAB, (rows, LENGTH)).astype(np.int32)


def save_random(config, directory: str, *, jitter: float = 0.0):
  """A random `transformers` causal LM of `config` (every weight moved by `jitter` times a
  normal draw, so that biases at 0 and norm scales at 1 matter), saved to `directory`;
  returns the model, in eval mode. Draws from torch's global generator: seed it first."""
  import torch
  import transformers
  model = transformers.AutoModelForCausalLM.from_config(config).eval()
  if jitter:
    with torch.no_grad():
      for p in model.parameters():
        p.add_(torch.randn_like(p) * jitter)
  model.save_pretrained(directory)
  return model


def hf_outputs(model, token_ids: np.ndarray, **kwargs):
  """`transformers`' outputs for `token_ids` (`kwargs` to the model's call)."""
  import torch
  with torch.no_grad():
    return model(torch.tensor(token_ids, dtype=torch.long), **kwargs)


def hf_logits(model, token_ids: np.ndarray) -> np.ndarray:
  return hf_outputs(model, token_ids).logits.numpy()


def run_config(path: str, layout: str = "fsdp", **overrides) -> ml_collections.ConfigDict:
  """`configs/lm.py:<layout>` shrunk (`tiny_lm_config`), its model the checkpoint's
  (`hf.model_fields`), started from it."""
  config = tiny_lm_config(layout, **overrides)
  config.model = ml_collections.ConfigDict(hf.model_fields(path))
  config.init_from.path = path
  return config


def lm_batch(token_ids: np.ndarray) -> dict[str, np.ndarray]:
  return {"inputs": token_ids, "targets": np.roll(token_ids, -1, axis=1)}


def our_outputs(trainer, state, token_ids: np.ndarray):
  """The model's outputs (logits, or an MoE's `MoeOutput`) for `token_ids` in eval mode,
  from `state` in the trainer's strategy."""
  canonical = trainer.strategy.to_canonical(state)
  return jax.jit(lambda params, model_state: trainer.model_variables.apply(
      params, model_state, ((token_ids,), {}), rngs={"dropout": jax.random.PRNGKey(0)},
      train=False)[0])(canonical.params, canonical.model_state)


def finetune_and_export(config, tmp_path, num_steps: int):
  """`num_steps` steps of `config` on the synthetic token stream, checkpointed at the end in
  `tmp_path/run`, then exported (`trainer.export`) to `tmp_path/export`. Returns the trainer,
  the final state, the export's tensor names and its directory."""
  import json
  import os

  from trainer.checkpoint import Checkpointer
  from trainer.export import export_checkpoint
  from trainer.language_model import LanguageModelTrainer, synthetic_token_batches

  trainer = LanguageModelTrainer(config)
  workdir, out = str(tmp_path / "run"), str(tmp_path / "export")
  checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"), every_steps=0,
                              async_save=False)
  stream = lambda start: synthetic_token_batches(0, 16, LENGTH, VOCAB, start)  # noqa: E731
  result = trainer.fit(stream, num_steps=num_steps, checkpointer=checkpointer)
  checkpointer.close()
  # The config as the CLI reads it back from JSON.
  written = export_checkpoint(workdir, out, config=json.loads(config.to_json()))
  return trainer, result.state, written, out
