"""Mixtures of experts (models/moe.py) and expert parallelism (strategies/expert.py).

Against one device: logits at atol 1e-5 and parameters after 3 steps within the chaos
yardstick (the router losses and their gradients included) for the Linen transformer and
the NNX Llama module under the expert layouts of `configs/lm.py`, dropless and with a
capacity. Mixtral and Qwen3-MoE weights from `transformers` (tiny random models built
offline): logits and the load-balancing loss equal transformers', under one device and
expert parallelism; a fine-tune's export reloads in transformers with equal logits; a
device reads only its experts' tensors. The refusals, each before compute.
"""

import itertools
import json
import os

import jax
import jax.numpy as jnp
import numerics
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
from user_models import ExpertDecoderTrainer

from models import moe
from strategies.expert import ExpertError
from trainer.language_model import LanguageModelTrainer, synthetic_token_batches

STEPS = 3
EXPERTS = 8


def _config(layout="data_parallel", family="transformer", capacity=None, **overrides):
  config = tiny_lm_config(layout, **overrides)
  config.model.update(num_experts=EXPERTS, capacity_factor=capacity)
  if family != "user":  # tests/user_models.py:ExpertDecoder: its own fields.
    config.model.family = family
  if family == "llama":  # 8 query heads read 2 key/value heads.
    config.model.update(head_dim=None, num_kv_heads=2)
  return config


def _trainer(config, family):
  return (ExpertDecoderTrainer if family == "user" else LanguageModelTrainer)(config)


def _batches(config, num=STEPS + 1):
  return list(itertools.islice(synthetic_token_batches(
      config.seed, config.batch_size, config.seq_len, config.model.vocab_size), num))


_REFERENCES = {}


def _reference(family, capacity):
  """One device: the first batch's predictions, the parameters after 3 steps, chaos runs."""
  key = (family, capacity)
  if key not in _REFERENCES:
    config = _config(family=family, capacity=capacity, **{"strategy.name": "single_device"})
    trainer = _trainer(config, family)
    batches = _batches(config)
    state = trainer.init_state(batches[0])
    predictions = trainer.predict(state, batches[STEPS])
    result = trainer.fit(batches[:STEPS], num_steps=STEPS, state=state)
    chaos = numerics.chaos_fits(trainer, batches[:STEPS], num_steps=STEPS,
                                view=lambda s: jax.device_get(s.params))
    _REFERENCES[key] = predictions, jax.device_get(result.state.params), chaos
  return _REFERENCES[key]


CASES = [  # family, layout, capacity factor (None: dropless)
    ("transformer", "data_expert", 1.0),  # Linen; 2 data x 4 expert; tokens dropped.
    ("llama", "expert", None),  # NNX; 8 experts over 8 devices, one each.
    ("llama", "expert_tensor", None),  # 2 expert x 4 model: each expert's MLP split.
    # 2 data x 2 stages x 2 model: the router's statistics through the pipeline's stages.
    ("llama", "pipeline_tensor", None),
    # A user's NNX decoder (tests/user_models.py), Flax's attention, dropout, its own loss,
    # under 2 data x 4 expert with the expert weights also split over data (FSDP).
    ("user", "expert_fsdp", None),
]


@pytest.mark.parametrize("family,layout,capacity", CASES,
                         ids=[f"{f}-{layout}-{c or 'dropless'}" for f, layout, c in CASES])
def test_expert_parallel_equals_one_device(family, layout, capacity):
  want, want_params, chaos = _reference(family, capacity)
  config = _config(layout, family, capacity)
  config.model.num_layers = 2
  trainer = _trainer(config, family)
  pipelined = layout.startswith("pipeline")
  if not pipelined:
    assert trainer.strategy.expert.axis == "expert"
  batches = _batches(config)
  state = trainer.init_state(batches[0])
  np.testing.assert_allclose(trainer.predict(state, batches[STEPS]), want, atol=1e-5)
  if not pipelined:  # Each device holds its share of the experts.
    w = next(x for path, x in jax.tree_util.tree_leaves_with_path(state.params)
             if "gate_proj" in jax.tree_util.keystr(path))
    assert "expert" in str(w.sharding.spec), w.sharding
  result = trainer.fit(batches[:STEPS], num_steps=STEPS, state=state)
  numerics.assert_equivalent(jax.device_get(result.state.params), want_params, chaos)


def test_the_step_exchanges_tokens_by_all_to_all():
  """The tokens and expert ids go, the results come back, and the backward pass transposes
  them: the step holds all-to-alls."""
  from trainer.plan import count_collectives
  config = _config("data_expert", capacity=1.0)
  trainer = LanguageModelTrainer(config)
  batch = _batches(config, 1)[0]
  state = trainer.init_state(batch)
  found = count_collectives(trainer.compiled.train_text(state, batch))
  assert found.get("all-to-all", 0) >= 4, found


def test_capacity_keeps_first_choices_and_earlier_tokens_first():
  # One sequence of 4 tokens, top-2 of 2 experts, capacity 3 per expert: each expert gets
  # all 4 first-or-second choices; the 4th token's second choice is the one dropped.
  ids = jnp.array([[[0, 1], [0, 1], [1, 0], [0, 1]]])
  keep = np.asarray(moe.within_capacity(ids, 2, 3))
  # First choices: expert 0 three times (tokens 0, 1, 3), expert 1 once (token 2).
  # Second choices then fill expert 1 (tokens 0, 1) and expert 0 is full for token 2's.
  np.testing.assert_array_equal(keep[0], [[True, True], [True, True], [True, False],
                                          [True, False]])
  assert moe.capacity(16, 2, 8, 1.0) == 4 and moe.capacity(16, 2, 8, 1.25) == 5
  assert bool(moe.within_capacity(ids, 2, None).all())  # Dropless keeps every choice.


def test_router_metrics_are_logged_and_its_losses_join_the_loss():
  """With capacity 0.5 about half the choices drop, and the step's metrics say so; the loss is
  the cross-entropy plus `config.moe`'s weights times the router losses, whose gradient
  reaches the router's probabilities."""
  config = _config(capacity=0.5, **{"strategy.name": "single_device"})
  trainer = LanguageModelTrainer(config)
  batch = _batches(config, 1)[0]
  _, out = jax.jit(trainer.steps.train)(trainer.init_state(batch), batch)
  logged = {k: float(v) for k, v in out["metrics"].compute().items()}
  assert 0.3 < logged["moe_dropped_fraction"] < 0.7
  shares = [logged[f"moe_expert_{e}_share"] for e in range(EXPERTS)]
  assert sum(shares) == pytest.approx(1.0, rel=1e-5)
  assert logged["moe_max_load"] == pytest.approx(max(shares) * EXPERTS, rel=1e-5)
  assert logged["moe_load_balance"] >= 2.0 - 1e-3  # top_k when balanced, above else.

  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.normal(size=(*batch["inputs"].shape, config.model.vocab_size)),
                       jnp.float32)
  stats = moe.RouterStats(*(jnp.asarray(rng.uniform(1, 2, size=shape), jnp.float32)
                            for shape in ((EXPERTS,), (EXPERTS,), (), (), ())))

  @jax.jit
  def loss(stats):
    return trainer.loss(moe.MoeOutput(logits, stats), batch)

  router = moe.summarize(stats)
  np.testing.assert_allclose(loss(stats), jax.jit(trainer.loss)(logits, batch) + 0.01 * router[
      "load_balance"] + 0.001 * router["router_z"], rtol=1e-6)
  grads = jax.jit(jax.grad(lambda s: loss(s).mean()))(stats)
  assert float(jnp.abs(grads.probs).min()) > 0 and float(jnp.abs(grads.z)) > 0


# -- Refusals -------------------------------------------------------------------------------

def test_moe_refusals_name_the_field():
  with pytest.raises(ExpertError, match=r"config.model.num_experts=6 does not divide over "
                                        r"the 'expert' mesh axis \(expert=8"):
    config = _config("expert")
    config.model.num_experts = 6
    trainer = LanguageModelTrainer(config)
    trainer.init_state(_batches(config, 1)[0])
  with pytest.raises(moe.MoeError, match=r"num_experts_per_tok=9 must be between 1 and "
                                         r"config.model.num_experts=8"):
    config = _config(**{"strategy.name": "single_device"})
    config.model.num_experts_per_tok = 9
    LanguageModelTrainer(config).init_state(_batches(config, 1)[0])
  for bad in (0.0, -1.0):
    with pytest.raises(moe.MoeError, match=rf"capacity_factor={bad} must be above 0"):
      config = _config(capacity=bad, **{"strategy.name": "single_device"})
      LanguageModelTrainer(config).init_state(_batches(config, 1)[0])
  with pytest.raises(ExpertError, match=r"no parameter of the model names an 'expert' axis"):
    config = tiny_lm_config("expert")
    config.model.num_experts = None  # A dense model.
    LanguageModelTrainer(config).init_state(_batches(config, 1)[0])
  with pytest.raises(ExpertError, match=r"split it over 'expert' too"):
    config = _config("expert")
    config.strategy.logical_axis_rules = (("batch", None),) + tuple(
        config.strategy.logical_axis_rules[1:])
    LanguageModelTrainer(config)


# -- Mixtral and Qwen3-MoE weights ----------------------------------------------------------

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from trainer.interop import families, hf  # noqa: E402

TOKENS = np.random.default_rng(0).integers(0, VOCAB, (8, LENGTH)).astype(np.int32)
WIDTHS = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False,
              num_experts_per_tok=2)


def _hf_config(kind):
  if kind == "mixtral":
    return transformers.MixtralConfig(**WIDTHS, intermediate_size=24,
                                      num_local_experts=EXPERTS)
  return transformers.Qwen3MoeConfig(**WIDTHS, intermediate_size=48, moe_intermediate_size=24,
                                     num_experts=EXPERTS, head_dim=8, norm_topk_prob=False)


def _hf_outputs(model, tokens=TOKENS):
  with torch.no_grad():
    out = model(torch.tensor(tokens, dtype=torch.long), output_router_logits=True)
  return out.logits.numpy(), float(out.aux_loss)


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
  torch.manual_seed(0)
  out = {}
  for kind in ("mixtral", "qwen3_moe"):  # Norm scales start at 1: every weight moved.
    directory = str(tmp_path_factory.mktemp(kind))
    out[kind] = (directory, *_hf_outputs(save_random(_hf_config(kind), directory,
                                                     jitter=0.05)))
  return out


_hf_config_run = run_config


def _batch(tokens=TOKENS):
  return lm_batch(tokens)


def _our_outputs(trainer, state, tokens=TOKENS):
  out = our_outputs(trainer, state, tokens)
  return np.asarray(out.logits), float(moe.summarize(out.router)["load_balance"])


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_logits_and_load_balance_equal_transformers(hf_models, kind):
  path, reference, aux_loss = hf_models[kind]
  assert hf.model_fields(path)["num_experts"] == EXPERTS
  for layout in ("data_parallel", "expert", "data_expert"):
    config = _hf_config_run(path, layout)
    if layout == "data_parallel":
      config.strategy.name = "single_device"
    trainer = LanguageModelTrainer(config)
    state = trainer.init_state(_batch())
    logits, load_balance = _our_outputs(trainer, state)
    np.testing.assert_allclose(logits, reference, atol=ATOL, rtol=0,
                               err_msg=f"{kind} under {layout}")
    # transformers' aux_loss: its load_balancing_loss_func over both layers' router logits.
    assert load_balance == pytest.approx(aux_loss, rel=1e-4), layout


def test_each_device_reads_only_its_experts(hf_models, monkeypatch):
  """Under `expert` (8 devices, one expert each) every per-expert HF tensor is read once,
  by the device holding that expert, never once per device."""
  reads = []
  read = hf.SafetensorsFiles.read
  monkeypatch.setattr(hf.SafetensorsFiles, "read", lambda self, name, index=None: (
      reads.append(name), read(self, name, index))[1])
  path, reference, _ = hf_models["mixtral"]
  trainer = LanguageModelTrainer(_hf_config_run(path, "expert"))
  state = trainer.init_state(_batch())
  np.testing.assert_allclose(_our_outputs(trainer, state)[0], reference, atol=ATOL, rtol=0)
  expert_reads = {}
  for name in reads:
    if ".experts." in name:
      expert_reads[name] = expert_reads.get(name, 0) + 1
  assert len(expert_reads) == 2 * EXPERTS * 3  # Layers x experts x (w1, w2, w3).
  assert set(expert_reads.values()) == {1}, expert_reads


@pytest.mark.parametrize("kind,layout", [("mixtral", "data_expert"),
                                         ("qwen3_moe", "expert_fsdp")])
def test_finetune_then_export_loads_in_transformers(hf_models, kind, layout, tmp_path):
  path, reference, _ = hf_models[kind]
  config = _hf_config_run(path, layout, learning_rate=1e-2)
  trainer, state, written, out = finetune_and_export(config, tmp_path, num_steps=2)
  ours, _ = _our_outputs(trainer, state)
  assert np.abs(ours - reference).max() > 1e-3  # The fine-tune moved the model.
  assert "model.layers.1.mlp.experts.7.down_proj.weight" in written or (
      "model.layers.1.block_sparse_moe.experts.7.w2.weight" in written)
  exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  assert type(exported).__name__ == families.get(kind).architecture
  np.testing.assert_allclose(_hf_outputs(exported)[0], ours, atol=ATOL, rtol=0)


def test_other_routings_are_refused_naming_the_field(hf_models, tmp_path):
  path, _, _ = hf_models["qwen3_moe"]
  with open(os.path.join(path, hf.CONFIG)) as f:
    hf_config = json.load(f)
  for change, match in ((dict(scoring_func="sigmoid"), r"scoring_func='sigmoid'"),
                        (dict(n_shared_experts=1), r"n_shared_experts=1: shared experts"),
                        (dict(n_group=4, topk_group=2), r"n_group=4: grouped routing"),
                        (dict(mlp_only_layers=[0]), r"mlp_only_layers=\[0\]: dense layers")):
    with pytest.raises(families.UnsupportedModelError, match=match):
      families.get("qwen3_moe").fields({**hf_config, **change})


def test_one_hot_einsum_dispatch_equals_the_grouped_products():
  """The benchmark's baseline computes the same function: capacity 1.0 drops choices, and
  both drop the same ones."""
  keys = jax.random.split(jax.random.key(0), 5)
  x = jax.random.normal(keys[0], (2, 16, 8))
  w_gate, w_up = (jax.random.normal(k, (4, 8, 12)) for k in keys[1:3])
  w_down = jax.random.normal(keys[3], (4, 12, 8))
  gates, ids, _ = moe.route(jax.random.normal(keys[4], (2, 16, 4)) * 3, 2, True)
  limit = moe.capacity(16, 2, 4, 1.0)
  keep = moe.within_capacity(ids, 4, limit)
  assert not bool(keep.all())
  grouped = moe.expert_ffn(x, ids, gates, keep, w_gate, w_up, w_down, limit)
  einsum = moe.einsum_experts(x, ids, gates, w_gate, w_up, w_down, limit)
  np.testing.assert_allclose(einsum, grouped, atol=1e-4, rtol=1e-5)


def _emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                                recv_sizes, *, axis_name):
  """`jax.lax.ragged_all_to_all`'s documented semantics from all-gathers, which XLA:CPU
  compiles: sender `i`'s slice for this device lands at `output_offsets` it chose."""
  del recv_sizes
  me = jax.lax.axis_index(axis_name)
  everyone = [jax.lax.all_gather(a, axis_name) for a in (operand, input_offsets, send_sizes,
                                                          output_offsets)]
  rows = jnp.arange(output.shape[0])
  for i in range(everyone[0].shape[0]):
    start, count, there = (a[i, me] for a in everyone[1:])
    inside = (rows >= there) & (rows < there + count)
    source = everyone[0][i][jnp.clip(rows - there + start, 0, operand.shape[0] - 1)]
    mask = inside.reshape((-1,) + (1,) * (output.ndim - 1))
    output = jnp.where(mask, source, output)
  return output


def test_the_ragged_exchange_equals_the_padded_one(monkeypatch, capacity=1.0):
  """The exchange GPUs and TPUs take (`ragged_all_to_all`, which XLA:CPU does not compile),
  its offsets and sizes checked here through an emulation of the collective's documented
  semantics: predictions and one step's parameters equal the fixed-size exchange's, with a
  capacity (choices dropped: fewer sent than the buffer holds)."""
  import dataclasses
  calls = []
  monkeypatch.setattr(jax.lax, "ragged_all_to_all", lambda *a, **k: (
      calls.append(k["axis_name"]), _emulated_ragged_all_to_all(*a, **k))[1])
  results = {}
  for exchange in ("all_to_all", "ragged_all_to_all"):
    config = _config("data_expert", capacity=capacity)
    trainer = LanguageModelTrainer(config)
    trainer.strategy.expert = dataclasses.replace(trainer.strategy.expert, exchange=exchange)
    batches = _batches(config, 2)
    state = trainer.init_state(batches[0])
    predictions = trainer.predict(state, batches[1])
    state = trainer.fit(batches[:1], num_steps=1, state=state).state
    results[exchange] = predictions, jax.device_get(state.params)
    assert bool(calls) == (exchange == "ragged_all_to_all")
  np.testing.assert_allclose(results["ragged_all_to_all"][0], results["all_to_all"][0],
                             atol=1e-6)
  for a, b in zip(jax.tree.leaves(results["ragged_all_to_all"][1]),
                  jax.tree.leaves(results["all_to_all"][1]), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
