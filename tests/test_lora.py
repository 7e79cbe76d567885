"""LoRA (`config.lora`, Qwix's adapters): what a step computes, what it trains, where it lives.

The adapted model's logits equal the base model's with each adapted weight
replaced by `W + alpha / rank * A @ B`, written out here; only the adapters
change in training and only they have optimizer state (the dry run's optimizer
bytes fall to theirs); under FSDP an adapter is sharded like its weight; a sweep
of LoRA learning rates trains as one ensemble program; what cannot work is
refused before compute.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from small_configs import tiny_lm_config

from trainer.checkpoint.init_from import _flatten
from trainer.language_model import LanguageModelTrainer, synthetic_token_batches
from trainer.plan import make_plan, shard_bytes
from trainer.step import lora as lora_lib

VOCAB, LENGTH, RANK, ALPHA = 32, 16, 2, 4.0
TARGETS = (".*attn/c_attn/kernel", ".*mlp/c_fc/kernel")
GPT2 = dict(family="gpt2", vocab_size=VOCAB, num_layers=2, embed_dim=32, num_heads=4,
            mlp_dim=64, max_len=LENGTH, layer_norm_epsilon=1e-5, dropout_rate=0.0)


def _config(layout="fsdp", rank=RANK, **overrides):
  config = tiny_lm_config(layout, learning_rate=3e-2, **overrides)
  config.model = ml_collections.ConfigDict(GPT2)
  config.lora.rank = rank
  config.lora.alpha = ALPHA
  config.lora.targets = TARGETS if rank else ()
  return config


def _stream(start):
  return synthetic_token_batches(0, 16, LENGTH, VOCAB, start)


def _host(params):
  return {k: np.asarray(v) for k, v in _flatten(nn.meta.unbox(params)).items()}


@pytest.fixture(scope="module")
def trained():
  """A LoRA run of 2 steps under FSDP: (trainer, initial and final host parameters)."""
  trainer = LanguageModelTrainer(_config())
  state = trainer.init_state(next(_stream(0)))
  before = _host(trainer.strategy.to_canonical(state).params)
  result = trainer.fit(_stream, num_steps=2, state=state)
  return trainer, result.state, before, _host(trainer.strategy.to_canonical(result.state).params)


def test_only_adapters_train_and_only_they_have_optimizer_state(trained):
  trainer, state, before, after = trained
  adapters = sorted(p for p in after if p.endswith(("_lora_a", "_lora_b")))
  assert adapters == sorted(f"blocks/{m}/kernel{s}" for m in ("attn/c_attn", "mlp/c_fc")
                            for s in ("_lora_a", "_lora_b"))
  for path in after:
    moved = float(np.abs(after[path] - before[path]).max())
    assert (moved > 0) == (path in adapters), (path, moved)
  assert np.abs(before["blocks/attn/c_attn/kernel_lora_b"]).max() == 0  # B starts at zero.
  moments = [x.shape for x in jax.tree.leaves(trainer.strategy.to_canonical(state).opt_state)
             if np.ndim(x)]
  assert sorted(moments) == sorted(2 * [after[p].shape for p in adapters])  # Adam's m and v.


def test_a_step_computes_the_weights_plus_the_scaled_adapter_product(trained):
  trainer, state, _, after = trained
  tokens = next(_stream(7))["inputs"]
  params = trainer.strategy.to_canonical(state).params
  ours = np.asarray(jax.jit(lambda p: trainer.model_variables.apply(
      p, {}, ((tokens,), {}), rngs={}, train=False)[0])(params))
  # By hand: the base GPT-2 with each adapted kernel replaced by W + alpha/r * A @ B.
  base = {p: x for p, x in after.items() if "_lora_" not in p}
  for module in ("attn/c_attn", "mlp/c_fc"):
    w = after[f"blocks/{module}/kernel"]
    a, b = after[f"blocks/{module}/kernel_lora_a"], after[f"blocks/{module}/kernel_lora_b"]
    delta = np.einsum("lir,lro->lio", a, b).reshape(w.shape)
    base[f"blocks/{module}/kernel"] = w + ALPHA / RANK * delta
  plain = LanguageModelTrainer(_config(rank=0))
  tree = {}
  for path, x in base.items():
    node = tree
    *parents, last = path.split("/")
    for name in parents:
      node = node.setdefault(name, {})
    node[last] = jnp.asarray(x)
  expected = np.asarray(plain.model_variables.apply(tree, {}, ((tokens,), {}), rngs={},
                                                    train=False)[0])
  # Same float32 products in another order: ~1e-6 of logits of size ~1.
  np.testing.assert_allclose(ours, expected, atol=1e-5, rtol=1e-5)
  assert np.abs(expected - np.asarray(plain.model_variables.apply(
      jax.tree.map(jnp.asarray, _nest({p: x for p, x in after.items() if "_lora_" not in p})),
      {}, ((tokens,), {}), rngs={}, train=False)[0])).max() > 1e-4  # The adapters matter.
  merged = lora_lib.merged(after, {"rank": RANK, "alpha": ALPHA})
  assert sorted(merged) == sorted(base)
  for path in base:
    np.testing.assert_allclose(merged[path], base[path], rtol=1e-6, atol=1e-7)


def _nest(flat):
  tree = {}
  for path, x in flat.items():
    node = tree
    *parents, last = path.split("/")
    for name in parents:
      node = node.setdefault(name, {})
    node[last] = x
  return tree


def test_adapters_are_laid_out_like_their_weights_and_optimizer_bytes_fall(trained):
  trainer, state, _, _ = trained
  params = state.params
  spec = lambda p: tuple(nn.meta.unbox(p).sharding.spec)  # noqa: E731
  c_fc = params["blocks"]["mlp"]["c_fc"]
  # FSDP maps embed -> data: the kernel [layer, embed, mlp] and its A [layer, embed, rank].
  assert spec(c_fc["kernel"])[:2] == (None, "data")
  assert spec(c_fc["kernel_lora_a"])[:2] == (None, "data")
  batch = next(_stream(0))
  # Tensor parallel maps mlp -> model: the kernel [layer, embed, mlp] and its B [layer, rank,
  # mlp] are split over the model axis alike.
  tensor = LanguageModelTrainer(_config("data_tensor")).init_state(batch).params
  c_fc = tensor["blocks"]["mlp"]["c_fc"]
  assert spec(c_fc["kernel"])[2] == "model" and spec(c_fc["kernel_lora_b"])[2] == "model"
  full = make_plan(LanguageModelTrainer(_config(rank=0)), batch)
  adapted = make_plan(trainer, batch)
  adapter_bytes = sum(shard_bytes(nn.meta.unbox(x)) for p, x in
                      jax.tree_util.tree_leaves_with_path(params, is_leaf=_boxed)
                      if "_lora_" in jax.tree_util.keystr(p))
  # Adam's two moments of the adapters, per device, and its step counts: nothing of the base.
  assert 2 * adapter_bytes <= adapted.opt_state_bytes <= 2 * adapter_bytes + 16
  assert adapted.opt_state_bytes < full.opt_state_bytes / 3


def _boxed(x):
  return isinstance(x, nn.Partitioned)


def test_a_sweep_of_lora_learning_rates_is_one_ensemble_program():
  config = _config("data_parallel")
  config.strategy.name = "sharded_ensemble"
  config.strategy.logical_axis_rules = ()
  config.strategy.mesh_shape = ()
  config.strategy.mesh_axes = ()
  config.strategy.ensemble_mesh_shape = (2, -1)  # Each member on 4 devices.
  config.sweep.grid.learning_rate = (1e-2, 1e-1)
  config.seed = 3
  config.sweep.seeds = (3,)
  trainer = LanguageModelTrainer(config)
  state = trainer.init_state(next(_stream(0)))
  before = _host(trainer.strategy.to_canonical(state).params)
  state = trainer.fit(_stream, num_steps=2, state=state).state
  after = _host(trainer.strategy.to_canonical(state).params)
  for path, x in after.items():
    assert x.shape[0] == 2  # Members.
    if "_lora_" in path:
      assert np.abs(x[0] - before[path][0]).max() < np.abs(x[1] - before[path][1]).max()
    else:
      np.testing.assert_array_equal(x, before[path])


def test_what_cannot_work_is_refused_before_compute():
  config = _config()
  config.lora.targets = (".*attn/c_attn/kernel", ".*nothing.*")
  with pytest.raises(ValueError, match=r"targets entry '.\*nothing.\*' matches no parameter"):
    LanguageModelTrainer(config).init_state(next(_stream(0)))
  config = _config()
  config.lora.targets = (".*ln_1/scale",)
  with pytest.raises(ValueError, match=r"match \['blocks/ln_1/scale'\], which no matrix"):
    LanguageModelTrainer(config).init_state(next(_stream(0)))
  config = _config()
  config.lora.rank = -1
  with pytest.raises(ValueError, match=r"config.lora.rank=-1 must be a positive integer"):
    LanguageModelTrainer(config)
  # Under a pipeline the adapters would be silently unused (the stack applies its layers
  # outside Qwix's interception): refused.
  with pytest.raises(ValueError, match=r"config.lora with config.strategy.mesh_axes=.*'stage'"):
    LanguageModelTrainer(_config("pipeline_tensor"))
  config = _config()
  config.freeze = ("ln_f/.*",)
  with pytest.raises(ValueError, match=r"config.freeze=\('ln_f/.\*',\) with config.lora"):
    LanguageModelTrainer(config)
  config = _config()
  config.model = ml_collections.ConfigDict(dict(
      family="llama", vocab_size=VOCAB, num_layers=2, embed_dim=32, num_heads=4,
      num_kv_heads=2, head_dim=8, mlp_dim=48, max_len=LENGTH))
  with pytest.raises(ValueError, match=r"config.lora: this model is an NNX one"):
    LanguageModelTrainer(config)
