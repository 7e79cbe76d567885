"""Hugging Face checkpoints in and out, checked against `transformers` itself (PyTorch, CPU).

Tiny random GPT-2 and Llama models are made with `transformers` and saved with
`save_pretrained` (nothing is downloaded). Loaded here through
`config.init_from.path`, our modules' logits equal transformers' under one
device, FSDP and data x tensor parallelism; fine-tuned a few steps and exported
(`trainer.export`), transformers loads the export and its logits equal ours.
Checkpoints that cannot be this model are refused before any compute, naming
the tensors; a sharded load reads each device's slice, not whole tensors.
"""

import json
import os

import jax
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

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from trainer.checkpoint import Checkpointer  # noqa: E402
from trainer.export import export_checkpoint  # noqa: E402
from trainer.interop import families, hf  # noqa: E402
from trainer.language_model import LanguageModelTrainer, synthetic_token_batches  # noqa: E402

TOKENS = np.random.default_rng(0).integers(0, VOCAB, (4, LENGTH)).astype(np.int32)


def _hf_configs():
  return {
      "gpt2": transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2,
                                      n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0),
      "llama": transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, max_position_embeddings=32,
                                        tie_word_embeddings=False),
  }


def _hf_logits(model, tokens=TOKENS):
  with torch.no_grad():
    return model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
  """`{family: (directory, reference logits, HF tensor names)}` of tiny random models."""
  torch.manual_seed(0)
  out = {}
  for name, config in _hf_configs().items():
    directory = str(tmp_path_factory.mktemp(name))
    model = save_random(config, directory)
    from safetensors import safe_open
    with safe_open(os.path.join(directory, hf.WEIGHTS), framework="np") as f:
      names = sorted(f.keys())
    out[name] = (directory, _hf_logits(model), names)
  return out


_config = run_config  # configs/lm.py keeps a Llama's 2 key/value heads whole.


def _batch(tokens=TOKENS):
  return lm_batch(tokens)


def _our_logits(trainer, state, tokens=TOKENS):
  if trainer.strategy.checkpoint_layout()["num_members"]:
    raise AssertionError("one model expected")
  return np.asarray(our_outputs(trainer, state, tokens))


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_logits_equal_transformers_under_every_layout(hf_models, family):
  path, reference, _ = hf_models[family]
  for layout in ("data_parallel", "fsdp", "data_tensor"):
    trainer = LanguageModelTrainer(_config(path, layout))
    state = trainer.init_state(_batch())
    np.testing.assert_allclose(_our_logits(trainer, state), reference, atol=ATOL, rtol=0,
                               err_msg=f"{family} under {layout}")
    # The optimizer starts from the loaded weights: its moments are zeros of their shapes.
    assert all(float(np.abs(np.asarray(x)).max()) == 0.0 for x in jax.tree.leaves(
        trainer.strategy.to_canonical(state).opt_state) if np.ndim(x) > 1)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_pipeline_runs_the_loaded_blocks(hf_models, family):
  """2 data x 2 stages x 2 model: the eval loss through the pipelined layer stack equals the
  cross-entropy of transformers' logits."""
  path, reference, _ = hf_models[family]
  trainer = LanguageModelTrainer(_config(path, "pipeline_tensor"))
  batch = _batch()
  state = trainer.init_state(batch)
  assert any("stage" in str(x.sharding.spec) for x in jax.tree.leaves(state.params))
  shifted = reference - reference.max(-1, keepdims=True)
  log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
  expected = -np.take_along_axis(log_probs, batch["targets"][..., None], -1).mean()
  loss = trainer.evaluate(state, [batch])["loss"]
  np.testing.assert_allclose(loss, expected, rtol=1e-5)


@pytest.mark.parametrize("family,layout,lora", [("gpt2", "fsdp", False),
                                               ("llama", "data_tensor", False),
                                               ("gpt2", "data_tensor", True),
                                               ("llama", "data_tensor", True),
                                               ("llama", "pipeline_tensor", True),
                                               ("llama", "data_tensor", "nf4"),
                                               ("gpt2", "data_tensor", "int8")])
def test_finetune_then_export_loads_in_transformers(hf_models, family, layout, lora, tmp_path):
  """LoRA: the export merges the adapters into the weights transformers reads (Qwix's for
  GPT-2; folded into the weights for the NNX Llama, and under a pipeline); the targets are
  configs/finetune_lm.py:lora's, which name both families' kernels. QLoRA (`nf4`, `int8`):
  the base is quantized as it is loaded, and the export writes the dequantized base with
  the merged adapters."""
  path, reference, names = hf_models[family]
  config = _config(path, layout, learning_rate=1e-2)
  if lora:
    from configs import finetune_lm
    config.lora.update(rank=4, alpha=8.0, targets=finetune_lm.get_config("lora").lora.targets)
  if isinstance(lora, str):
    config.lora.update(base_dtype=lora, block_size=4)
  trainer, state, written, out = finetune_and_export(config, tmp_path, num_steps=3)
  ours = _our_logits(trainer, state)
  assert np.abs(ours - reference).max() > 1e-3  # The fine-tune moved the model.
  # The export holds HF's names, as transformers' own save does (a tied head is not saved).
  assert written == [n for n in names if n != "lm_head.weight" or family == "llama"]
  exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  assert type(exported).__name__ == families.get(family).architecture
  np.testing.assert_allclose(_hf_logits(exported), ours, atol=ATOL, rtol=0)


def test_a_quantized_base_is_loaded_a_shard_at_a_time_as_it_would_be_whole(hf_models):
  """QLoRA from an HF checkpoint under data x tensor: each device quantizes the blocks that
  cover its shard of each weight as it reads them (down_proj's input axis, and with it its
  blocks, is split over `model`); the codes and scales equal Qwix quantizing the loaded
  weight whole."""
  import flax.linen as nn
  import qwix

  from configs import finetune_lm
  from trainer.checkpoint.init_from import _flatten

  path, _, _ = hf_models["llama"]
  states, placed = {}, None
  for base_dtype in ("", "nf4"):
    config = _config(path, "data_tensor")
    config.lora.update(rank=4, alpha=8.0, targets=finetune_lm.get_config("lora").lora.targets,
                       base_dtype=base_dtype, block_size=4)
    trainer = LanguageModelTrainer(config)
    placed = trainer.init_state(_batch())
    states[base_dtype] = trainer.strategy.to_canonical(placed)
  down = placed.params["blocks"]["layers"]["mlp"]["down_proj"]["kernel"].array
  assert nn.meta.unbox(down.qvalue).sharding.spec[1] == "model"  # [layer, mlp, embed].
  loaded = {p: np.asarray(x) for p, x in _flatten(nn.meta.unbox(states[""].params)).items()}
  ours = {p: np.asarray(x) for p, x in _flatten(nn.meta.unbox(states["nf4"].params)).items()}
  weights = sorted(p[:-len("/array/qvalue")] for p in ours if p.endswith("/array/qvalue"))
  assert len(weights) == 7
  for weight in weights:
    codes, scale = ours[weight + "/array/qvalue"], ours[weight + "/array/scale"]
    tiles = {a: n // k for a, (n, k) in enumerate(zip(codes.shape, scale.shape, strict=True))}
    whole = qwix.quantize(loaded[weight], "nf4",
                          channelwise_axes=[a for a, t in tiles.items() if t == 1],
                          tiled_axes={a: t for a, t in tiles.items() if 1 < t < codes.shape[a]})
    np.testing.assert_array_equal(np.asarray(whole.qvalue).view(np.uint8), codes.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(whole.scale), scale)


def test_ensemble_member_exports(hf_models, tmp_path):
  path, _, _ = hf_models["gpt2"]
  config = _config(path, "fsdp", learning_rate=1e-2)
  config.strategy.name = "sharded_ensemble"
  config.ensemble_size = 2
  config.strategy.ensemble_mesh_shape = (2, -1)
  config.strategy.logical_axis_rules = ()
  config.strategy.mesh_shape = ()
  config.strategy.mesh_axes = ()
  # Both members start from the checkpoint; their own dropout keys make them differ.
  config.model.dropout_rate = 0.1
  trainer = LanguageModelTrainer(config)
  workdir = str(tmp_path / "run")
  checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"), every_steps=0,
                              async_save=False)
  stream = lambda start: synthetic_token_batches(0, 16, LENGTH, VOCAB, start)  # noqa: E731
  state = trainer.fit(stream, num_steps=2, checkpointer=checkpointer).state
  checkpointer.close()
  canonical = trainer.strategy.to_canonical(state)
  ours = []
  for i in range(2):
    member = jax.tree.map(lambda x, i=i: x[i], canonical)
    ours.append(np.asarray(trainer.model_variables.apply(
        member.params, member.model_state, ((TOKENS,), {}),
        rngs={"dropout": jax.random.PRNGKey(0)}, train=False)[0]))
  assert np.abs(ours[0] - ours[1]).max() > 1e-4
  with pytest.raises(ValueError, match=r"holds an ensemble of 2; pass --member"):
    export_checkpoint(workdir, str(tmp_path / "no"), config=json.loads(config.to_json()))
  out = str(tmp_path / "member1")
  export_checkpoint(workdir, out, member=1, config=json.loads(config.to_json()))
  exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  np.testing.assert_allclose(_hf_logits(exported), ours[1], atol=ATOL, rtol=0)


def test_sharded_checkpoint_is_read_slice_by_slice(hf_models, tmp_path):
  """The sharded (`model.safetensors.index.json`) form; under FSDP over 8 devices no read is
  larger than an eighth of the largest tensor."""
  torch.manual_seed(1)
  config = _hf_configs()["llama"]
  model = transformers.AutoModelForCausalLM.from_config(config).eval()
  directory = str(tmp_path / "sharded")
  model.save_pretrained(directory, max_shard_size="20KB")
  assert os.path.isfile(os.path.join(directory, hf.INDEX))
  trainer = LanguageModelTrainer(_config(directory, "fsdp"))
  state = trainer.init_state(_batch())
  # One file of the sharded form, named alone: its `config.json` beside it, half the tensors.
  one_file = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))[0]
  with pytest.raises(ValueError, match=r"(?s)does not hold the 'llama' model .* missing"):
    hf.open_source(os.path.join(directory, one_file))
  np.testing.assert_allclose(_our_logits(trainer, state), _hf_logits(model), atol=ATOL, rtol=0)
  files = trainer.states.source.handle
  largest = max(int(np.prod(files.shape(n))) * 4 for n in files.names())
  total = sum(int(np.prod(files.shape(n))) * 4 for n in files.names())
  assert files.largest_read <= largest // 8, (files.largest_read, largest)
  assert files.bytes_read >= total  # Every tensor was read (each device its part).


def test_checkpoints_that_are_not_this_model_are_refused(monkeypatch, hf_models, tmp_path):
  from safetensors.numpy import load_file, save_file

  path, _, _ = hf_models["llama"]
  tensors = load_file(os.path.join(path, hf.WEIGHTS))
  with open(os.path.join(path, hf.CONFIG)) as f:
    hf_config = json.load(f)

  def variant(name, tensors, **config_changes):
    directory = tmp_path / name
    directory.mkdir()
    save_file(tensors, str(directory / hf.WEIGHTS))
    (directory / hf.CONFIG).write_text(json.dumps({**hf_config, **config_changes}))
    return str(directory)

  extra = variant("extra", {**tensors, "model.layers.0.self_attn.q_norm.weight":
                            np.ones(8, np.float32)})
  with pytest.raises(ValueError, match=r"1 tensor\(s\) .* match no rule .*q_norm"):
    LanguageModelTrainer(_config(extra))
  missing = variant("missing", {k: v for k, v in tensors.items()
                                if not k.startswith("model.layers.1.mlp.up_proj")})
  with pytest.raises(ValueError, match=r"up_proj/kernel: missing \['model.layers.1.mlp"):
    LanguageModelTrainer(_config(missing))
  swiglu = variant("gelu", tensors, hidden_act="gelu")
  with pytest.raises(families.UnsupportedModelError, match=r"hidden_act='gelu'.*\('silu',\)"):
    LanguageModelTrainer(_config(swiglu))
  # The run's config.model differs from the checkpoint's config.json: refused by its fields,
  # before the model is built, naming both values.
  config = _config(path)
  config.model.mlp_dim = 40
  with pytest.raises(ValueError, match=r"config.model.mlp_dim=40, but the checkpoint .* has "
                                       r"mlp_dim=48"):
    LanguageModelTrainer(config)
  config = _config(path)
  config.model.tie_word_embeddings = True
  with pytest.raises(ValueError, match=r"config.model.tie_word_embeddings=True, but .* has "
                                       r"tie_word_embeddings=False"):
    LanguageModelTrainer(config)
  # Tensors that differ from their own config.json: refused by shapes, before compute.
  narrow = variant("narrow", {k: v[:40] if ".mlp.up_proj." in k else v
                              for k, v in tensors.items()})
  with pytest.raises(ValueError,
                     match=r"(?s)differ in shape.*mlp/up_proj/kernel. has shape \(2, 32, 48\) "
                           r"in the new model but .* has shape \(2, 32, 40\)"):
    LanguageModelTrainer(_config(narrow)).init_state(_batch())
  # Past the fields' check (skipped here), the loader still refuses by names: the untied
  # checkpoint's head goes to no variable of a tied model.
  monkeypatch.setattr(hf, "check_model_config", lambda model, path: None)
  config = _config(path)
  config.model.tie_word_embeddings = True
  with pytest.raises(ValueError, match=r"go to no variable of the new model: \['lm_head/kernel"):
    LanguageModelTrainer(config).init_state(_batch())
  with pytest.raises(families.UnsupportedModelError, match=r"config.model.family='transformer'"):
    hf.export({}, {"family": "transformer"}, str(tmp_path / "never"))
  assert not os.path.exists(tmp_path / "never")
