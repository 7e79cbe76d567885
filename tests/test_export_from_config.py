"""A model trained from a config (not loaded from a checkpoint), with its family's own fields
left at the family's default, exports as a Hugging Face model that `transformers` loads
and computes as ours does.

`configs/lm.py` leaves each family's fields None ("the family's default"); an export writes
the value each computed with, so `from_pretrained`'s strict config classes accept it. The
same fields are typed, so a flag sets them.
"""

import json
import subprocess
import sys

import numpy as np
import pytest
from hf_fixtures import ATOL, LENGTH, VOCAB, finetune_and_export, our_outputs, tokens
from small_configs import tiny_lm_config

from configs import lm as lm_config
from trainer.interop import families

transformers = pytest.importorskip("transformers")
pytest.importorskip("torch")

#: The MoE families need experts: the rest of their fields stay at the family's default.
MOE = dict(num_experts=4, num_experts_per_tok=2)


def _config(family):
  config = tiny_lm_config("data_parallel", learning_rate=1e-2)
  config.model.update(family=family, vocab_size=VOCAB)
  if family in ("mixtral", "qwen3_moe"):
    config.model.update(MOE)
  return config


@pytest.mark.parametrize("family", sorted(families.FAMILIES))
def test_a_model_trained_from_a_config_exports_and_reloads_with_equal_logits(family, tmp_path):
  config = _config(family)
  left = [k for k in lm_config.family_fields() if config.model[k] is None]
  assert left  # Some of the family's own fields are left at its default.
  trainer, state, _, out = finetune_and_export(config, tmp_path, num_steps=1)
  written = json.loads((tmp_path / "export" / "config.json").read_text())
  nulls = sorted(k for k, v in written.items() if v is None and k != "sliding_window")
  assert not nulls, f"{family}: the export writes null for {nulls}"
  exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  assert type(exported).__name__ == families.get(family).architecture
  ids = tokens(2)
  ours = our_outputs(trainer, state, ids)
  ours = np.asarray(getattr(ours, "logits", ours))[..., :VOCAB]
  import torch
  with torch.no_grad():
    theirs = exported(torch.tensor(ids, dtype=torch.long)).logits.numpy()
  assert theirs.shape == (2, LENGTH, VOCAB)
  np.testing.assert_allclose(theirs, ours, atol=ATOL, rtol=0)


def test_each_familys_own_fields_are_set_by_flag():
  """`--config.model.num_kv_heads=2` and the other family fields parse as their types."""
  code = ("import sys; from absl import flags; from trainer import config as c; "
          "c.define_config_file('configs/lm.py', ''); flags.FLAGS(sys.argv); "
          "m = flags.FLAGS.config.model; "
          "print(repr((m.num_kv_heads, m.rope_theta, m.rms_norm_eps, m.tie_word_embeddings, "
          "m.layer_norm_epsilon, m.dropout_rate)))")
  flags = ["--config.model.num_kv_heads=2", "--config.model.rope_theta=500000",
           "--config.model.rms_norm_eps=1e-5", "--config.model.tie_word_embeddings=true",
           "--config.model.layer_norm_epsilon=1e-6", "--config.model.dropout_rate=0.1"]
  from pathlib import Path
  root = Path(__file__).resolve().parent.parent
  done = subprocess.run([sys.executable, "-c", code, *flags], capture_output=True, text=True,
                        cwd=root, check=False)
  assert done.returncode == 0, done.stderr[-2000:]
  assert done.stdout.strip() == repr((2, 500000.0, 1e-5, True, 1e-6, 0.1))


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_a_mixture_of_experts_family_without_experts_is_refused_before_compute(family):
  from trainer.language_model import LanguageModelTrainer
  config = tiny_lm_config("data_parallel")
  config.model.family = family
  with pytest.raises(ValueError, match=rf"family='{family}' is a mixture of experts.*"
                                       r"num_experts=0; set it"):
    LanguageModelTrainer(config)
