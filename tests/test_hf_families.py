"""The families people fine-tune now, on the Llama module: Llama 3.1's scaled rope, Mistral
(its sliding window computed), Qwen2 (q/k/v biases) and Qwen3 (per-head q/k RMSNorm).

Tiny random models built with `transformers` offline (every weight, biases and norm scales
included, moved off its initial value so that each one matters); our logits equal
transformers' under one device, FSDP and data x tensor; a fine-tune's export is reloaded
by transformers as the family's class with equal logits. What is not computed stays
refused, naming the field.
"""

import json
import os

import ml_collections
import numpy as np
import pytest
from small_configs import tiny_lm_config

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from trainer.checkpoint import Checkpointer  # noqa: E402
from trainer.export import export_checkpoint  # noqa: E402
from trainer.interop import families, hf  # noqa: E402
from trainer.language_model import LanguageModelTrainer, synthetic_token_batches  # noqa: E402

VOCAB, LENGTH = 64, 16
ATOL = 1e-4  # As tests/test_hf_interop.py: two libraries' float32 sums of these widths.
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
  for kind in KINDS:
    model = transformers.AutoModelForCausalLM.from_config(_hf_config(kind)).eval()
    with torch.no_grad():  # Biases start at 0 and norm scales at 1: move every weight.
      for p in model.parameters():
        p.add_(torch.randn_like(p) * 0.05)
    directory = str(tmp_path_factory.mktemp(kind))
    model.save_pretrained(directory)
    out[kind] = (directory, _hf_logits(model))
  return out


def _config(path, layout, **overrides):
  config = tiny_lm_config(layout, **overrides)
  config.model = ml_collections.ConfigDict(hf.model_fields(path))
  config.init_from.path = path
  return config


def _our_logits(trainer, state, tokens=TOKENS):
  import jax
  canonical = trainer.strategy.to_canonical(state)
  return np.asarray(jax.jit(lambda p, s: trainer.model_variables.apply(
      p, s, ((tokens,), {}), rngs={"dropout": jax.random.PRNGKey(0)}, train=False)[0])(
          canonical.params, canonical.model_state))


def _batch(tokens=TOKENS):
  return {"inputs": tokens, "targets": np.roll(tokens, -1, axis=1)}


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
    config.model[field] = None
    trainer = LanguageModelTrainer(config)
    logits = _our_logits(trainer, trainer.init_state(_batch()))
    assert np.abs(logits - reference).max() > 10 * ATOL, kind
  for kind, name in (("qwen2", "self_attn/q_proj/bias"), ("qwen3", "self_attn/k_norm/scale")):
    path, _ = hf_models[kind]
    trainer = LanguageModelTrainer(_config(path, "data_parallel"))
    params = trainer.strategy.to_canonical(trainer.init_state(_batch())).params
    value = np.asarray(params["blocks"]["layers"][name.split("/")[0]][name.split("/")[1]][
        name.split("/")[2]].value)
    assert np.abs(value - (1.0 if "norm" in name else 0.0)).min() > 0, kind


@pytest.mark.parametrize("kind,layout", [("llama3", "fsdp"), ("mistral", "data_tensor"),
                                         ("qwen2", "data_tensor"), ("qwen3", "fsdp")])
def test_finetune_then_export_loads_in_transformers(hf_models, kind, layout, tmp_path):
  path, reference = hf_models[kind]
  config = _config(path, layout, learning_rate=1e-2)
  trainer = LanguageModelTrainer(config)
  workdir = str(tmp_path / "run")
  checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"), every_steps=0,
                              async_save=False)
  stream = lambda start: synthetic_token_batches(0, 16, LENGTH, VOCAB, start)  # noqa: E731
  result = trainer.fit(stream, num_steps=2, checkpointer=checkpointer)
  checkpointer.close()
  ours = _our_logits(trainer, result.state)
  assert np.abs(ours - reference).max() > 1e-3
  out = str(tmp_path / "export")
  export_checkpoint(workdir, out, config=json.loads(config.to_json()))
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
