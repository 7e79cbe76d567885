"""The families people fine-tune now, on the Llama module: Llama 3.1's scaled rope, Mistral
(its sliding window computed), Qwen2 (q/k/v biases) and Qwen3 (per-head q/k RMSNorm).

Tiny random models built with `transformers` offline (every weight, biases and norm scales
included, moved off its initial value so that each one matters); our logits equal
transformers' under one device, FSDP and data x tensor; a fine-tune's export is reloaded
by transformers as the family's class with equal logits. What is not computed stays
refused, naming the field.
"""

import json

import ml_collections
import numpy as np
import pytest
from hf_fixtures import (
  ATOL,
  LENGTH,
  VOCAB,
  finetune_and_export,
  lm_batch,
  our_outputs,
  run_config,
  save_random,
)
from small_configs import tiny_lm_config

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from trainer.interop import families, hf  # noqa: E402
from trainer.language_model import LanguageModelTrainer  # noqa: E402

TOKENS = np.random.default_rng(0).integers(0, VOCAB, (4, LENGTH)).astype(np.int32)
WIDTHS = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
              tie_word_embeddings=False)


def _hf_config(kind):
  if kind == "llama3":  # Llama 3.1's rope: its wavelengths against an 8-token context.
    return transformers.LlamaConfig(**WIDTHS, rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
        high_freq_factor=4.0, original_max_position_embeddings=8))
  if kind == "mistral":  # A window of 4 over 16 tokens: most of the causal mask is cut.
    return transformers.MistralConfig(**WIDTHS, sliding_window=4)
  if kind == "qwen2":
    return transformers.Qwen2Config(**WIDTHS)
  return transformers.Qwen3Config(**WIDTHS, head_dim=8)


def _hf_logits(model, tokens=TOKENS):
  with torch.no_grad():
    return model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


KINDS = ("llama3", "mistral", "qwen2", "qwen3")


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
  torch.manual_seed(0)
  out = {}
  for kind in KINDS:  # Biases start at 0 and norm scales at 1: every weight moved.
    directory = str(tmp_path_factory.mktemp(kind))
    model = save_random(_hf_config(kind), directory, jitter=0.05)
    out[kind] = (directory, _hf_logits(model))
  return out


_config = run_config


def _batch(tokens=TOKENS):
  return lm_batch(tokens)


def _our_logits(trainer, state, tokens=TOKENS):
  return np.asarray(our_outputs(trainer, state, tokens))


@pytest.mark.parametrize("kind", KINDS)
def test_logits_equal_transformers_under_every_layout(hf_models, kind):
  path, reference = hf_models[kind]
  fields = hf.model_fields(path)
  expected = {"llama3": ("llama", "rope_scaling"), "mistral": ("mistral", "sliding_window"),
              "qwen2": ("qwen2", None), "qwen3": ("qwen3", None)}[kind]
  assert fields["family"] == expected[0]
  assert expected[1] is None or fields.get(expected[1])
  for layout in ("data_parallel", "fsdp", "data_tensor"):
    config = _config(path, layout)
    if layout == "data_parallel":
      config.strategy.name = "single_device"
    trainer = LanguageModelTrainer(config)
    state = trainer.init_state(_batch())
    np.testing.assert_allclose(_our_logits(trainer, state), reference, atol=ATOL, rtol=0,
                               err_msg=f"{kind} under {layout}")


def test_each_variant_changes_the_logits(hf_models):
  """The variants are computed, not ignored: without Llama 3.1's rope scaling or Mistral's
  window the same weights' logits move far past the tolerance; Qwen2's biases and Qwen3's
  q/k norm scales are loaded as saved (off their 0 and 1), so the equality above needs them."""
  for kind, field in (("llama3", "rope_scaling"), ("mistral", "sliding_window")):
    path, reference = hf_models[kind]
    config = _config(path, "data_parallel", **{"strategy.name": "single_device"})
    loaded = LanguageModelTrainer(config)
    state = loaded.init_state(_batch())
    # The same weights in the model without the variant (a run would be refused: below).
    config.model[field] = None
    config.init_from.path = ""
    without = LanguageModelTrainer(config)
    logits = _our_logits(without, state)
    assert np.abs(logits - reference).max() > 10 * ATOL, kind
  for kind, name in (("qwen2", "self_attn/q_proj/bias"), ("qwen3", "self_attn/k_norm/scale")):
    path, _ = hf_models[kind]
    trainer = LanguageModelTrainer(_config(path, "data_parallel"))
    params = trainer.strategy.to_canonical(trainer.init_state(_batch())).params
    value = np.asarray(params["blocks"]["layers"][name.split("/")[0]][name.split("/")[1]][
        name.split("/")[2]].value)
    assert np.abs(value - (1.0 if "norm" in name else 0.0)).min() > 0, kind


def test_a_run_whose_model_is_not_its_checkpoints_is_refused_before_compute(hf_models):
  # Llama 3.1's checkpoint with its rope scaling dropped from config.model: the shapes all
  # match, and before this check it loaded with logits far from transformers'.
  path, _ = hf_models["llama3"]
  config = _config(path, "data_parallel", **{"strategy.name": "single_device"})
  config.model.rope_scaling = None
  with pytest.raises(ValueError, match=r"config.model.rope_scaling=None, but the checkpoint "
                     r"at config.init_from.path=.* has rope_scaling=\{'factor': 8.0"):
    LanguageModelTrainer(config)
  config.model.rope_scaling = hf.model_fields(path)["rope_scaling"]
  config.model.family = "mistral"  # The same module, another family.
  with pytest.raises(ValueError, match=r"config.model.family='mistral', but .* is a 'llama' "
                     r"checkpoint"):
    LanguageModelTrainer(config)


def _write_config(tmp_path, name, fields):
  directory = tmp_path / name
  directory.mkdir()
  hf_config = families.get(fields["family"]).hf_config(fields)
  (directory / "config.json").write_text(json.dumps(hf_config))
  (directory / "model.safetensors").write_bytes(b"")  # Only its config.json is read.
  return str(directory)


_LLAMA = dict(family="llama", vocab_size=VOCAB, num_layers=2, embed_dim=32, num_heads=4,
              num_kv_heads=2, head_dim=None, mlp_dim=48, max_len=32, rms_norm_eps=1e-5,
              tie_word_embeddings=False, rope_theta=500000.0,
              rope_scaling=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                original_max_position_embeddings=8.0))
_MIXTRAL = dict(_LLAMA, family="mixtral", rope_scaling=None, rope_theta=1e6,
                sliding_window=None, num_experts=4, num_experts_per_tok=2, moe_mlp_dim=24,
                norm_topk_prob=True)


@pytest.mark.parametrize("base,field,value", [
    (_LLAMA, "rope_theta", 10000.0), (_LLAMA, "rms_norm_eps", 1e-6),
    (_LLAMA, "tie_word_embeddings", True), (_LLAMA, "num_kv_heads", 4),
    (dict(_LLAMA, rope_scaling=None, family="mistral", sliding_window=4), "sliding_window",
     None),
    (_MIXTRAL, "num_experts_per_tok", 1), (_MIXTRAL, "norm_topk_prob", False),
])
def test_every_field_that_changes_the_computation_is_compared(tmp_path, base, field, value):
  from trainer.config import check_config
  path = _write_config(tmp_path, "ckpt", base)
  config = tiny_lm_config("data_parallel")
  config.model = ml_collections.ConfigDict(hf.model_fields(path))
  config.init_from.path = path
  check_config(config)  # The checkpoint's own fields pass ...
  config.model[field] = value
  want = base.get(field)
  with pytest.raises(ValueError, match=rf"config.model.{field}={value!r}, but .* has "
                     rf"{field}={want!r}".replace("(", r"\(").replace(")", r"\)")):
    check_config(config)  # ... and one changed is refused, naming both values.
  config.model[field] = want
  config.model.max_len = 16  # A run's own choice: a shorter longest sequence.
  config.model.head_dim = None  # The family's default: embed_dim // num_heads, the same.
  check_config(config)


@pytest.mark.parametrize("kind,layout", [("llama3", "fsdp"), ("mistral", "data_tensor"),
                                         ("qwen2", "data_tensor"), ("qwen3", "fsdp")])
def test_finetune_then_export_loads_in_transformers(hf_models, kind, layout, tmp_path):
  path, reference = hf_models[kind]
  config = _config(path, layout, learning_rate=1e-2)
  trainer, state, _, out = finetune_and_export(config, tmp_path, num_steps=2)
  ours = _our_logits(trainer, state)
  assert np.abs(ours - reference).max() > 1e-3
  exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  family = families.get(config.model.family)
  assert type(exported).__name__ == family.architecture
  np.testing.assert_allclose(_hf_logits(exported), ours, atol=ATOL, rtol=0)


@pytest.mark.parametrize("hf_config,field", [
    (dict(model_type="llama", rope_parameters=dict(rope_type="yarn", factor=4.0)),
     "rope_type='yarn'"),
    (dict(model_type="qwen2", use_sliding_window=True), "use_sliding_window=True"),
    (dict(model_type="qwen3", layer_types=["full_attention", "sliding_attention"]),
     "'sliding_attention'"),
    (dict(model_type="qwen3", attention_bias=True), "attention_bias=True"),
    (dict(model_type="llama", rope_parameters=dict(rope_type="default",
                                                    partial_rotary_factor=0.5)),
     "partial_rotary_factor=0.5"),
])
def test_what_is_not_computed_is_refused_naming_the_field(hf_config, field):
  base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4)
  with pytest.raises(families.UnsupportedModelError, match=field.replace("[", r"\[")):
    families.get(hf_config["model_type"]).fields({**base, **hf_config})
