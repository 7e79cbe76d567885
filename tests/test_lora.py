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


#: A Llama (NNX, on the NnxLayerStack): its adapters are folded into the weights.
LLAMA = dict(family="llama", vocab_size=VOCAB, num_layers=4, embed_dim=32, num_heads=4,
             num_kv_heads=2, head_dim=8, mlp_dim=64, max_len=LENGTH)
#: q_proj [layer, embed, heads, kv] (one input axis), o_proj [layer, heads, kv, embed] (two),
#: down_proj [layer, mlp, embed] (an nnx.Linear).
LLAMA_TARGETS = (".*self_attn/[qo]_proj/kernel", ".*mlp/down_proj/kernel")
#: An NNX model is built from the step's streams (its initialisers are dead code here).
RNGS = {"params": jax.random.PRNGKey(0), "dropout": jax.random.PRNGKey(1)}


def _config(layout="fsdp", rank=RANK, family="gpt2", **overrides):
  config = tiny_lm_config(layout, learning_rate=3e-2, **overrides)
  config.model = ml_collections.ConfigDict(GPT2 if family == "gpt2" else LLAMA)
  if family == "gpt2" and layout in ("pipeline_tensor",):
    config.model.num_layers = 4
  config.lora.rank = rank
  config.lora.alpha = ALPHA
  config.lora.targets = (TARGETS if family == "gpt2" else LLAMA_TARGETS) if rank else ()
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
  config = _config()
  config.freeze = ("ln_f/.*",)
  with pytest.raises(ValueError, match=r"config.freeze=\('ln_f/.\*',\) with config.lora"):
    LanguageModelTrainer(config)
  config = _config(family="llama")
  config.lora.targets = (".*input_layernorm/scale",)  # NNX: a norm's scale is no kernel.
  with pytest.raises(ValueError, match=r"match \['blocks/layers/input_layernorm/scale'\], "
                                       r"which no Linear or LinearGeneral layer takes"):
    LanguageModelTrainer(config).init_state(next(_stream(0)))


@pytest.fixture(scope="module")
def llama_trained():
  """An NNX Llama with adapters under data x tensor, 2 steps."""
  trainer = LanguageModelTrainer(_config("data_tensor", family="llama"))
  state = trainer.init_state(next(_stream(0)))
  before = _host(trainer.strategy.to_canonical(state).params)
  result = trainer.fit(_stream, num_steps=2, state=state)
  return trainer, result.state, before, _host(trainer.strategy.to_canonical(result.state).params)


def test_an_nnx_model_on_the_layer_stack_trains_its_adapters_only(llama_trained):
  """The Llama (NNX, NnxLayerStack): adapters beside the matched kernels, only they move
  and only they have Adam's moments; B starts at zero."""
  trainer, state, before, after = llama_trained
  adapters = sorted(p for p in after if "_lora_" in p)
  assert adapters == sorted(f"blocks/layers/{m}/kernel{s}"
                            for m in ("self_attn/q_proj", "self_attn/o_proj", "mlp/down_proj")
                            for s in ("_lora_a", "_lora_b"))
  for path in after:
    moved = float(np.abs(after[path] - before[path]).max())
    assert (moved > 0) == (path in adapters), (path, moved)
  assert np.abs(before["blocks/layers/self_attn/o_proj/kernel_lora_b"]).max() == 0
  moments = [x.shape for x in jax.tree.leaves(trainer.strategy.to_canonical(state).opt_state)
             if np.ndim(x)]
  assert sorted(moments) == sorted(2 * [after[p].shape for p in adapters])


def test_an_nnx_step_computes_the_weights_plus_the_scaled_adapter_product(llama_trained):
  """Logits of the adapted Llama equal the base Llama's with each adapted kernel replaced by
  `W + alpha/r * A @ B` written out here (o_proj's A keeps both input axes, heads and kv)."""
  trainer, state, _, after = llama_trained
  tokens = next(_stream(7))["inputs"]
  params = trainer.strategy.to_canonical(state).params
  ours = np.asarray(jax.jit(lambda p: trainer.model_variables.apply(
      p, {}, ((tokens,), {}), rngs=RNGS, train=False)[0])(params))
  base = {p: x for p, x in after.items() if "_lora_" not in p}
  by_hand = dict(base)
  for module, inputs in (("self_attn/q_proj", "i"), ("self_attn/o_proj", "hd"),
                         ("mlp/down_proj", "i")):
    w = after[f"blocks/layers/{module}/kernel"]
    a = after[f"blocks/layers/{module}/kernel_lora_a"]
    b = after[f"blocks/layers/{module}/kernel_lora_b"]
    outputs = "".join("opq"[i] for i in range(w.ndim - 1 - len(inputs)))
    delta = np.einsum(f"l{inputs}r,lr{outputs}->l{inputs}{outputs}", a, b)
    by_hand[f"blocks/layers/{module}/kernel"] = w + ALPHA / RANK * delta
  plain = LanguageModelTrainer(_config(rank=0, family="llama"))
  apply = lambda tree: np.asarray(plain.model_variables.apply(  # noqa: E731
      jax.tree.map(jnp.asarray, _nest(tree)), {}, ((tokens,), {}), rngs=RNGS, train=False)[0])
  expected = apply(by_hand)
  np.testing.assert_allclose(ours, expected, atol=1e-5, rtol=1e-5)
  assert np.abs(expected - apply(base)).max() > 1e-4  # The adapters matter.
  merged = lora_lib.merged(after, {"rank": RANK, "alpha": ALPHA})  # What an export writes.
  for path in by_hand:
    np.testing.assert_allclose(merged[path], by_hand[path], rtol=1e-6, atol=1e-7)


def test_nnx_adapters_are_laid_out_like_their_weights(llama_trained):
  """data x tensor: A takes its kernel's leading and input axes' layout, B its output axes':
  q_proj's B [layer, rank, heads, kv] and o_proj's A [layer, heads, kv, rank] are split over
  `model` where their kernels' heads are."""
  _, state, _, _ = llama_trained
  spec = lambda p: tuple(nn.meta.unbox(p).sharding.spec)  # noqa: E731
  attn = state.params["blocks"]["layers"]["self_attn"]
  assert spec(attn["q_proj"]["kernel"])[2] == "model"
  assert spec(attn["q_proj"]["kernel_lora_b"])[2] == "model"
  assert "model" not in spec(attn["q_proj"]["kernel_lora_a"])
  assert spec(attn["o_proj"]["kernel"])[1] == "model"
  assert spec(attn["o_proj"]["kernel_lora_a"])[1] == "model"
  assert "model" not in spec(attn["o_proj"]["kernel_lora_b"])


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_lora_under_a_pipeline_equals_lora_without_one(family):
  """2 data x 2 stages x 2 model against data x tensor, 2 steps: the adapters are applied in
  the pipelined stack (they move, as they did not when the stack ran outside Qwix's
  interception) and equal the unpipelined run's within its float32 noise; the base weights
  stay bitwise where they were."""
  import numerics
  batches = [next(_stream(i)) for i in range(2)]
  config = _config("data_tensor", family=family)
  config.model.num_layers = 4  # As the pipeline's: 2 stages x 2 layers.
  reference = LanguageModelTrainer(config)
  start = _host(reference.strategy.to_canonical(reference.init_state(batches[0])).params)
  want = _host(reference.strategy.to_canonical(
      reference.fit(batches, num_steps=2).state).params)
  chaos = numerics.chaos_fits(reference, batches, num_steps=2, view=lambda s: _host(
      reference.strategy.to_canonical(s).params))
  piped = LanguageModelTrainer(_config("pipeline_tensor", family=family))
  assert piped.strategy.pipeline is not None
  got = _host(piped.strategy.to_canonical(piped.fit(batches, num_steps=2).state).params)
  adapters = sorted(p for p in got if "_lora_" in p)
  assert adapters and all(np.abs(got[p] - start[p]).max() > 0 for p in adapters)
  for path in got:
    if "_lora_" not in path:
      np.testing.assert_array_equal(got[path], start[path])
  numerics.assert_equivalent({p: got[p] for p in adapters}, {p: want[p] for p in adapters},
                             [{p: c[p] for p in adapters} for c in chaos])
