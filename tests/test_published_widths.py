"""Published models under every layout: GPT-2's real vocabulary (50257, which no split of 2,
4 or 8 divides) padded to the mesh with its padded logits masked, equal to one device and to
`transformers`; widths a rule cannot split refused before compute, naming the parameter, the
rule and the mesh sizes that would divide it; every LM layout running every family by flag;
damaged safetensors files named."""

import json
import os
import re

import jax
import jax.numpy as jnp
import ml_collections
import numerics
import numpy as np
import pytest
from small_configs import tiny_lm_config

import models
from configs import lm
from models.vocab import mask_padding, padded_size
from trainer.checkpoint import Checkpointer, CheckpointError
from trainer.interop import hf
from trainer.language_model import LanguageModelTrainer, synthetic_token_batches
from trainer.plan import make_plan

GPT2_VOCAB = 50257
LENGTH, BATCH, STEPS = 8, 4, 3
TOKENS = np.random.default_rng(0).integers(0, GPT2_VOCAB, (BATCH, LENGTH)).astype(np.int32)


def _batch(tokens=TOKENS):
  return {"inputs": tokens, "targets": np.roll(tokens, -1, axis=1)}


def _batches(seed=0, num=STEPS + 1):
  rng = np.random.default_rng(seed)
  return [_batch(rng.integers(0, GPT2_VOCAB, (BATCH, LENGTH)).astype(np.int32))
          for _ in range(num)]


def _logits(trainer, state, tokens=TOKENS):
  canonical = trainer.strategy.to_canonical(state)
  return np.asarray(jax.jit(lambda p, s: trainer.model_variables.apply(
      p, s, ((tokens,), {}), rngs={"dropout": jax.random.PRNGKey(0)}, train=False)[0])(
          canonical.params, canonical.model_state))


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
  """A tiny random GPT-2 with the real vocabulary, saved by `transformers`, and its logits."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  torch.manual_seed(0)
  config = transformers.GPT2Config(vocab_size=GPT2_VOCAB, n_positions=16, n_embd=16, n_layer=2,
                                   n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
  model = transformers.AutoModelForCausalLM.from_config(config).eval()
  directory = str(tmp_path_factory.mktemp("gpt2_50257"))
  model.save_pretrained(directory)
  with torch.no_grad():
    reference = model(torch.tensor(TOKENS, dtype=torch.long)).logits.numpy()
  return directory, reference


def _gpt2_config(path, layout, **overrides):
  config = tiny_lm_config(layout, batch_size=BATCH, eval_batch_size=BATCH, seq_len=LENGTH,
                          **overrides)
  config.model = ml_collections.ConfigDict(hf.model_fields(path))
  config.init_from.path = path
  return config


def test_gpt2_vocabulary_padded_under_data_tensor_equals_one_device(gpt2_dir, tmp_path):
  """2 data x 4 model (`vocab -> model`): the embedding carries 50260 rows split over `model`;
  logits, loss and 3 steps of training equal one device's unpadded model, the padded rows
  stay zero, and the export is transformers' 50257-token GPT-2 again."""
  transformers = pytest.importorskip("transformers")
  torch = pytest.importorskip("torch")
  path, reference = gpt2_dir
  batches = _batches()

  one = LanguageModelTrainer(_gpt2_config(path, "data_parallel", **{
      "strategy.name": "single_device"}))
  state = one.init_state(batches[0])
  assert state.params["token_embedding"]["embedding"].value.shape == (GPT2_VOCAB, 16)
  np.testing.assert_allclose(_logits(one, state), reference, atol=1e-4, rtol=0)
  want = one.fit(batches[:STEPS], num_steps=STEPS).state
  want_eval = one.evaluate(want, batches[STEPS:])["loss"]
  chaos = numerics.chaos_fits(one, batches[:STEPS], num_steps=STEPS,
                              view=lambda s: jax.device_get(s.params))
  want = jax.device_get(want.params)

  config = _gpt2_config(path, "data_tensor")
  tensor = LanguageModelTrainer(config)
  rows = padded_size(GPT2_VOCAB, 4)
  assert rows == 50260
  state = tensor.init_state(batches[0])
  embedding = state.params["token_embedding"]["embedding"].value
  assert embedding.shape == (rows, 16)
  assert embedding.sharding.spec == jax.sharding.PartitionSpec("model", None)
  logits = _logits(tensor, state)
  np.testing.assert_allclose(logits[..., :GPT2_VOCAB], reference, atol=1e-4, rtol=0)
  assert (logits[..., GPT2_VOCAB:] == np.finfo(np.float32).min).all()
  probabilities = tensor.predict(state, _batch())
  assert probabilities.shape == (BATCH, LENGTH, GPT2_VOCAB)  # The padding dropped.

  workdir = str(tmp_path / "run")
  checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"), every_steps=0,
                              async_save=False)
  got = tensor.fit(batches[:STEPS], num_steps=STEPS, checkpointer=checkpointer).state
  checkpointer.close()
  np.testing.assert_allclose(tensor.evaluate(got, batches[STEPS:])["loss"], want_eval,
                             rtol=1e-5)
  got_params = jax.device_get(got.params)
  padded = np.asarray(got_params["token_embedding"]["embedding"].value)
  assert (padded[GPT2_VOCAB:] == 0).all()  # Masked logits: no gradient reaches the padding.
  got_params["token_embedding"]["embedding"] = got_params["token_embedding"][
      "embedding"].replace_boxed(padded[:GPT2_VOCAB])
  numerics.assert_equivalent(got_params, want, chaos)

  from trainer.export import export_checkpoint
  out = str(tmp_path / "export")
  export_checkpoint(workdir, out, config=json.loads(config.to_json()))
  exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  assert exported.config.vocab_size == GPT2_VOCAB
  with torch.no_grad():
    theirs = exported(torch.tensor(TOKENS, dtype=torch.long)).logits.numpy()
  np.testing.assert_allclose(theirs, _logits(tensor, got)[..., :GPT2_VOCAB], atol=1e-4, rtol=0)

  plan = make_plan(tensor, batches[0])
  assert f"token_embedding/embedding ({rows}, 16) P('model', None)" in plan.report()


@pytest.mark.parametrize("family", ["transformer", "llama"])
def test_padded_logits_are_masked_so_loss_and_gradients_equal_the_unpadded_model(family):
  """One device, no layout: the model with 3 padded rows (filled with noise, which masking
  must hide) has the unpadded model's loss and gradients; the padded rows get none."""
  from flax import nnx
  vocab, multiple = 13, 8
  widths = dict(vocab_size=vocab, num_layers=1, embed_dim=16, num_heads=2, head_dim=8,
                mlp_dim=32, max_len=8)
  tokens = np.random.default_rng(1).integers(0, vocab, (2, 8)).astype(np.int32)
  targets = np.roll(tokens, -1, axis=1)

  def loss_fn(logits):
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, targets[..., None], -1).mean()

  if family == "transformer":
    small = models.TransformerLM(**widths)
    big = models.TransformerLM(**widths, vocab_multiple=multiple)
    params = small.init(jax.random.PRNGKey(0), tokens)["params"]
    noise = big.init(jax.random.PRNGKey(5), tokens)["params"]
    pad = lambda x, n: jnp.concatenate(  # noqa: E731
        [x, n[x.shape[0]:]] if x.shape[0] == vocab else [x, n[:, x.shape[1]:]],
        axis=0 if x.shape[0] == vocab else 1)
    big_params = jax.tree.map(lambda x, n: pad(x, n) if x.shape != n.shape else x,
                              nn_unbox(params), nn_unbox(noise))
    small_fn = lambda p: loss_fn(small.apply({"params": p}, tokens))  # noqa: E731
    big_fn = lambda p: loss_fn(big.apply({"params": p}, tokens))  # noqa: E731
    small_params = nn_unbox(params)
  else:
    from models.llama import LlamaLM
    widths.pop("head_dim")
    with nnx.use_eager_sharding(False):  # No mesh here: the annotations are metadata.
      small = LlamaLM(**widths, num_kv_heads=1, head_dim=8, rngs=nnx.Rngs(0))
      big = LlamaLM(**widths, num_kv_heads=1, head_dim=8, vocab_multiple=multiple,
                    rngs=nnx.Rngs(5))
    small_def, small_params = nnx.split(small, nnx.Param)
    big_def, noise = nnx.split(big, nnx.Param)
    small_params, noise = nnx.to_pure_dict(small_params), nnx.to_pure_dict(noise)

    def pad(x, n):
      if x.shape == n.shape:
        return x
      axis = 0 if x.shape[0] == vocab else 1
      return jnp.concatenate([x, jax.lax.slice_in_dim(n, vocab, n.shape[axis], axis=axis)],
                             axis=axis)
    big_params = jax.tree.map(pad, small_params, noise)

    def apply(graphdef, module, p):
      state = nnx.state(module, nnx.Param)
      nnx.replace_by_pure_dict(state, p)
      return nnx.merge(graphdef, state)(tokens)
    small_fn = lambda p: loss_fn(apply(small_def, small, p))  # noqa: E731
    big_fn = lambda p: loss_fn(apply(big_def, big, p))  # noqa: E731

  small_loss, small_grads = jax.value_and_grad(small_fn)(small_params)
  big_loss, big_grads = jax.value_and_grad(big_fn)(big_params)
  assert padded_size(vocab, multiple) == 16
  np.testing.assert_allclose(big_loss, small_loss, rtol=1e-6)
  unmasked = loss_fn(jnp.asarray(np.random.default_rng(2).normal(size=(2, 8, 16)),
                                 jnp.float32))
  assert abs(float(unmasked) - float(loss_fn(mask_padding(
      jnp.asarray(np.random.default_rng(2).normal(size=(2, 8, 16)), jnp.float32),
      vocab)))) > 1e-3  # The mask changes a softmax over noise in the padded columns.
  for g_small, g_big in zip(jax.tree.leaves(small_grads), jax.tree.leaves(big_grads),
                            strict=True):
    g_small, g_big = np.asarray(g_small), np.asarray(g_big)
    if g_small.shape == g_big.shape:
      np.testing.assert_allclose(g_big, g_small, rtol=1e-5, atol=1e-7)
      continue
    axis = 0 if g_small.shape[0] == vocab else 1
    np.testing.assert_allclose(np.take(g_big, np.arange(vocab), axis), g_small, rtol=1e-5,
                               atol=1e-7)
    assert (np.take(g_big, np.arange(vocab, 16), axis) == 0).all()


def nn_unbox(tree):
  import flax.linen as nn
  return nn.meta.unbox(tree)


@pytest.mark.parametrize("family,field,value,param,rule", [
    ("gpt2", "num_heads", 6, "params/blocks/attn/c_attn", "('heads', 'model')"),
    ("transformer", "mlp_dim", 30, "params/blocks/wi/kernel", "('mlp', 'model')"),
    ("llama", "num_heads", 6, "params/blocks/layers/self_attn/", "('heads', 'model')")])
def test_a_width_the_rule_cannot_split_is_refused_before_compute(family, field, value, param,
                                                                 rule):
  """In the trainer and in the dry run, naming the parameter, the dimension, the rule, the
  mesh axis and the sizes that divide it."""
  config = tiny_lm_config("data_tensor")
  config.model.family = family
  config.model.update({field: value, "embed_dim": 48, "head_dim": 8})
  if family == "llama":
    config.model.num_kv_heads = 2
  batch = next(synthetic_token_batches(0, config.batch_size, config.seq_len,
                                       config.model.vocab_size))
  name = "heads" if field == "num_heads" else "mlp"
  divisors = [d for d in range(1, 9) if value % d == 0 and 8 % d == 0]
  expected = (rf"(?s)parameter '{param}.*dimension \d of size {value} \(annotated '{name}'\)"
              rf".*mesh axis model \(model=4: 4 pieces\) by the rule {re.escape(rule)}.*"
              rf"4 does not divide {value}.*divide it on 8 devices: {re.escape(str(divisors))}")
  trainer = LanguageModelTrainer(config)
  with pytest.raises(ValueError, match=expected):
    make_plan(trainer, batch)
  with pytest.raises(ValueError, match=expected):
    trainer.init_state(batch)


def test_a_layer_count_the_stages_cannot_split_is_refused():
  config = tiny_lm_config("pipeline")
  config.model.num_layers = 6
  with pytest.raises(ValueError, match=r"(?s)6.*layers.*4"):
    LanguageModelTrainer(config).init_state(next(synthetic_token_batches(
        0, config.batch_size, config.seq_len, config.model.vocab_size)))


@pytest.mark.parametrize("layout", ["fsdp_tensor", "pipeline_tensor"])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_every_layout_runs_every_family_by_flag(layout, family):
  """configs/lm.py declares `model.family` and each family's own fields (None: its default),
  so `--config.model.family=gpt2` is all a layout needs; a field the family does not have is
  refused."""
  config = lm.get_config(layout)
  assert config.model.family == "transformer"
  config.model.family = family
  config.model.update(num_layers=4, embed_dim=32, num_heads=4, head_dim=8, mlp_dim=64,
                      vocab_size=GPT2_VOCAB, max_len=16)
  config.update(seq_len=8, batch_size=16)
  trainer = LanguageModelTrainer(config)
  batch = next(synthetic_token_batches(0, config.batch_size, config.seq_len, GPT2_VOCAB))
  report = make_plan(trainer, batch).report()
  embedding = "token_embedding" if family == "gpt2" else "embed_tokens"
  rows = padded_size(GPT2_VOCAB, dict(trainer.strategy.mesh.shape)["model"])
  assert f"{embedding}/embedding ({rows}, 32)" in report
  other = "num_kv_heads" if family == "gpt2" else "layer_norm_epsilon"
  config.model[other] = 2 if family == "gpt2" else 1e-5
  with pytest.raises(ValueError, match=rf"config.model.{other}=.*'{family}' family's model "
                                       r"has no such field"):
    LanguageModelTrainer(config)


def test_damaged_safetensors_files_are_named(tmp_path):
  """A truncated file, a shard the index names that is missing, and a tensor the index places
  in a shard that does not hold it: each refused before compute naming the file (and the
  tensor), where safetensors' own error names neither."""
  from safetensors.numpy import save_file
  fields = dict(family="gpt2", vocab_size=32, num_layers=1, embed_dim=8, num_heads=2,
                mlp_dim=16, max_len=8, layer_norm_epsilon=1e-5, dropout_rate=0.0)
  rng = np.random.default_rng(0)
  from trainer.interop import families
  mapping = hf.ResolvedRules(families.get("gpt2"), fields)
  tensors = {}
  for rule in mapping.rules:
    shape = hf.Conversion(rule, mapping.dims, ()).hf_shape if rule.split else None
    for name in mapping.hf_names(rule):
      tensors[name] = rng.normal(size=shape or _plain_shape(rule, fields)).astype(np.float32)
  config = families.get("gpt2").hf_config(fields)

  whole = tmp_path / "truncated"
  whole.mkdir()
  save_file(tensors, str(whole / hf.WEIGHTS))
  (whole / hf.CONFIG).write_text(json.dumps(config))
  hf.open_source(str(whole))  # Whole, it opens.
  data = (whole / hf.WEIGHTS).read_bytes()
  (whole / hf.WEIGHTS).write_bytes(data[:len(data) * 2 // 3])
  run = tiny_lm_config("fsdp")
  run.model = ml_collections.ConfigDict(fields)
  run.init_from.path = str(whole)
  with pytest.raises(CheckpointError, match=rf"{whole / hf.WEIGHTS} \(\d+ bytes\) is not a "
                                            r"readable safetensors file.*truncated"):
    LanguageModelTrainer(run)  # The source is opened with the trainer: before any compute.

  sharded = tmp_path / "sharded"
  sharded.mkdir()
  names = sorted(tensors)
  halves = {"model-00001-of-00002.safetensors": names[::2],
            "model-00002-of-00002.safetensors": names[1::2]}
  for file, part in halves.items():
    save_file({n: tensors[n] for n in part}, str(sharded / file))
  weight_map = {n: file for file, part in halves.items() for n in part}
  (sharded / hf.CONFIG).write_text(json.dumps(config))
  (sharded / hf.INDEX).write_text(json.dumps({"weight_map": weight_map}))
  hf.open_source(str(sharded))
  moved = names[0]
  (sharded / hf.INDEX).write_text(json.dumps({"weight_map": {
      **weight_map, moved: "model-00002-of-00002.safetensors"}}))
  with pytest.raises(CheckpointError, match=rf"places tensor '{moved}' in "
                                            rf"{sharded}/model-00002-of-00002.safetensors, "
                                            r"which does not hold it; it is in .*00001"):
    hf.open_source(str(sharded))
  (sharded / hf.INDEX).write_text(json.dumps({"weight_map": weight_map}))
  os.remove(sharded / "model-00002-of-00002.safetensors")
  with pytest.raises(CheckpointError, match=rf"{sharded}/model-00002-of-00002.safetensors is "
                                            rf"missing: the index places {len(names[1::2])} "
                                            rf"tensor\(s\) in it \(\['{names[1]}'"):
    hf.open_source(str(sharded))


def _plain_shape(rule, fields):
  """The HF shape of a rule without a split (GPT-2's: embeddings, norms, MLP, biases)."""
  e, v, n, f = fields["embed_dim"], fields["vocab_size"], fields["max_len"], fields["mlp_dim"]
  return {"wte.weight": (v, e), "wpe.weight": (n, e), "h.{i}.mlp.c_fc.weight": (e, f),
          "h.{i}.mlp.c_fc.bias": (f,), "h.{i}.mlp.c_proj.weight": (f, e)}.get(rule.hf, (e,))
