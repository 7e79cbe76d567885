"""Blockwise attention (`config.attention.method='blockwise'`): memory linear in the length.

Forward and gradients for every input equal plain attention (atol 1e-5) with causal masks,
packed segments (a length that is not a multiple of the block), sliding windows,
grouped-query heads and attention dropout; a model trained by the Trainer runs it by
config alone, under one device and data x tensor parallelism, with the same logits and
gradients; the dry run's step temporaries for the long-context guide's model at 8,192
tokens are at most 1/8 of plain attention's; bad fields are refused naming them.
"""

import importlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from small_configs import tiny_lm_config

from models import attention as attention_lib
from models import attention_blocks
from trainer.language_model import LanguageModelTrainer

CASES = {
    "causal_segments": dict(causal=True, segments=True),
    "window_gqa": dict(causal=True, window=5, kv_heads=2),
    "dropout": dict(causal=True, segments=True, rate=0.3),
    "bidirectional": dict(causal=False, segments=True, kv_heads=1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_forward_and_gradients_equal_plain_attention(case):
  fields = CASES[case]
  b, length, heads, d, size = 2, 37, 4, 8, 8  # 37: the last block padded.
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  kv = fields.get("kv_heads", heads)
  q = jax.random.normal(keys[0], (b, length, heads, d))
  k = jax.random.normal(keys[1], (b, length, kv, d))
  v = jax.random.normal(keys[2], (b, length, kv, d))
  cotangent = jax.random.normal(keys[3], q.shape)
  segments = jnp.zeros((b, length), jnp.int32)
  if fields.get("segments"):  # Three packed documents, then padding (0).
    segments = jnp.asarray(np.repeat([[1] * 12 + [2] * 15 + [3] * 7 + [0] * 3], b, 0))
  rate = fields.get("rate", 0.0)

  def loss(method):
    def f(q, k, v):
      with attention_lib.using(attention_lib.Method(method, size)):
        out = attention_lib.attention(
            q, k, v, segment_ids=segments, causal=fields["causal"],
            window=fields.get("window"), dropout_rate=rate,
            dropout_rng=jax.random.PRNGKey(7), deterministic=rate == 0)
      return jnp.sum(out * cotangent), out
    return jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(q, k, v)

  (_, plain), plain_grads = loss("plain")
  (_, blockwise), blockwise_grads = loss("blockwise")
  np.testing.assert_allclose(blockwise, plain, atol=1e-5, rtol=0)
  for name, got, want in zip("qkv", blockwise_grads, plain_grads, strict=True):
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0, err_msg=f"d{name}")
  assert float(jnp.abs(plain).max()) > 0.1


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_model_runs_it_by_config_alone(family):
  """The same state, plain and blockwise (block 4 of 16 tokens): equal logits and equal
  gradients of the loss, under one device and data x tensor."""
  tokens = np.random.default_rng(0).integers(0, 32, (16, 16)).astype(np.int32)
  batch = {"inputs": tokens, "targets": np.roll(tokens, -1, axis=1)}
  for layout in ("single_device", "data_tensor"):
    results = {}
    for method in ("plain", "blockwise"):
      config = tiny_lm_config("data_tensor", **{"model.family": family})
      if family == "llama":
        config.model.num_kv_heads = 2
      if layout == "single_device":
        config.strategy.name = "single_device"
      config.attention.method, config.attention.block_size = method, 4
      trainer = LanguageModelTrainer(config)
      state = trainer.init_state(batch)
      canonical = trainer.strategy.to_canonical(state)
      mv = trainer.model_variables

      def loss(params, mv=mv, canonical=canonical, batch=batch):
        logits = mv.apply(params, canonical.model_state, ((batch["inputs"],), {}),
                          rngs={"params": jax.random.PRNGKey(0)}, train=False)[0]
        logp = jax.nn.log_softmax(logits.astype(jnp.float32))
        return -jnp.take_along_axis(logp, batch["targets"][..., None], -1).mean(), logits

      (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(canonical.params)
      results[method] = (np.asarray(logits), jax.tree.leaves(grads))
    np.testing.assert_allclose(results["blockwise"][0], results["plain"][0], atol=1e-5, rtol=0,
                               err_msg=f"{family} {layout}")
    for got, want in zip(results["blockwise"][1], results["plain"][1], strict=True):
      np.testing.assert_allclose(got, want, atol=1e-5, rtol=0, err_msg=f"{family} {layout}")


def test_the_dry_run_at_8192_tokens_needs_an_eighth_of_the_temporaries():
  """The long-context guide's model (configs/lm.py's LM, 2 layers x 64, 8 heads), one
  sequence of 8,192 tokens on one device: blockwise step temporaries <= 1/8 of plain's."""
  from configs import lm
  from trainer.plan import make_plan
  temps = {}
  for method in ("plain", "blockwise"):
    config = lm.get_config("data_parallel")
    config.strategy.name = "single_device"
    config.seq_len = config.model.max_len = 8192
    config.batch_size = 1
    config.attention.method = method
    trainer = LanguageModelTrainer(config)
    tokens = np.zeros((1, 8192), np.int32)
    temps[method] = make_plan(trainer, {"inputs": tokens, "targets": tokens}).temp_bytes
  assert temps["blockwise"] * 8 <= temps["plain"], temps


@pytest.mark.parametrize("field, value, message", [
    ("method", "flash", r"config\.attention\.method='flash' is not one of \('plain', "
                        r"'blockwise'\)"),
    ("block_size", 0, r"config\.attention\.block_size=0 must be an int >= 1"),
    ("implementation", "triton", r"config\.attention\.implementation='triton' is not one of "
                                 r"\('auto', 'xla', 'cudnn'\)"),
    ("implementation", "xla", r"config\.attention\.implementation='xla' chooses what runs the "
                              r"blockwise method, but config\.attention\.method='plain'"),
])
def test_bad_fields_are_refused(field, value, message):
  config = tiny_lm_config("data_parallel")
  config.attention[field] = value
  with pytest.raises(ValueError, match=message):
    LanguageModelTrainer(config)


def test_cudnn_is_refused_where_it_cannot_run_before_any_step():
  """`implementation='cudnn'` is refused when the step is traced, before it runs, naming the
  field and why: here the backend is a CPU; under a context axis the context methods run.
  (The init traces in float32 by XLA's schedule.)"""
  tokens = np.zeros((16, 16), np.int32)
  batch = {"inputs": tokens, "targets": tokens}
  for layout, why in (("data_parallel", r"the backend is cpu, not a GPU"),
                      ("context", r"the sequence is split over the 'context' mesh axis")):
    config = tiny_lm_config(layout)
    config.attention.update(method="blockwise", implementation="cudnn")
    trainer = LanguageModelTrainer(config)
    state = trainer.init_state(batch)
    with pytest.raises(ValueError, match=r"config\.attention\.implementation='cudnn': this "
                                         r"attention call cannot run as cuDNN's fused kernel: "
                                         + why):
      trainer.compiled.train(state).trace(state, trainer.strategy.put_batch(batch))


@pytest.mark.parametrize("causal, window, kv", [(True, None, 4), (True, 5, 2), (False, None, 1)])
def test_the_fused_kernels_arguments_give_plain_attention(causal, window, kv):
  """On a GPU blockwise runs as cuDNN's fused kernel where it can: the call's causal mask,
  window, grouped heads and scale, mapped to `jax.nn.dot_product_attention`, give plain
  attention (checked here through its XLA implementation; cuDNN itself needs a GPU)."""
  keys = jax.random.split(jax.random.PRNGKey(3), 3)
  b, length, heads, d = 2, 24, 4, 8
  q = jax.random.normal(keys[0], (b, length, heads, d))
  k, v = (jax.random.normal(key, (b, length, kv, d)) for key in keys[1:])
  block = attention_blocks.Block(causal=causal, window=window, scale=0.3, rate=0.0, seed=None,
                                 total_heads=heads, length=length)
  want = attention_lib._plain(block, q, k, v, jnp.zeros((b, length), jnp.int32), None, False)
  np.testing.assert_allclose(attention_lib._fused(block, q, k, v, None), want, atol=1e-5,
                             rtol=0)


def test_what_the_fused_kernel_cannot_express_falls_back_to_blockwise():
  bf16 = jnp.zeros((1, 16, 4, 64), jnp.bfloat16)
  ok = dict(packed=False, dropout=False, window=None, causal=True)
  assert attention_lib.fused_fallback(bf16, bf16, **ok) is None
  assert attention_lib.fused_fallback(bf16, bf16, **{**ok, "window": 8}) is None
  cases = {"operands of float32": (bf16.astype(jnp.float32), ok),
           "head width 12": (jnp.zeros((1, 16, 4, 12), jnp.bfloat16), ok),
           "segment_ids": (bf16, {**ok, "packed": True}),
           "attention dropout": (bf16, {**ok, "dropout": True}),
           "a window without the causal mask": (bf16, {**ok, "window": 8, "causal": False})}
  for reason, (q, fields) in cases.items():
    assert reason in attention_lib.fused_fallback(q, q, **fields)


@pytest.mark.parametrize("implementation", ["auto", "xla"])
def test_on_a_gpu_a_call_cudnn_refuses_runs_blockwise_in_xla(implementation, monkeypatch,
                                                             caplog):
  """On a GPU backend `auto` tries cuDNN's fused kernel for a call it can express; where jax
  refuses it (here: no cuDNN on this machine) XLA's blockwise schedule runs, and the log
  says why. `xla` never tries the kernel."""
  monkeypatch.setattr(attention_lib, "_backend", lambda: "gpu")
  monkeypatch.setattr(attention_lib, "_LOGGED", set())
  tried = []
  fused = attention_lib._fused
  monkeypatch.setattr(attention_lib, "_fused",
                      lambda *a: tried.append(a[-1]) or fused(*a))
  keys = jax.random.split(jax.random.PRNGKey(5), 3)
  q, k, v = (jax.random.normal(key, (2, 24, 4, 8), jnp.bfloat16) for key in keys)
  with attention_lib.using(attention_lib.Method("plain")):
    want = attention_lib.attention(q, k, v)
  with caplog.at_level("INFO"), attention_lib.using(
      attention_lib.Method("blockwise", 8, implementation)):
    got = attention_lib.attention(q, k, v)
  # bfloat16 outputs: each is its float32 result rounded to 8 bits of mantissa, so the two
  # differ by at most one bfloat16 step of the value (2**-7 of it from 1 up; 2**-7 below 1).
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  assert np.all(np.abs(got - want) <= 2 ** -7 * np.maximum(1.0, np.abs(want))), \
      np.abs(got - want).max()
  if implementation == "xla":
    assert tried == [] and "cuDNN" not in caplog.text
  else:
    assert tried == ["cudnn"]
    assert "XLA's blockwise schedule instead of cuDNN's fused kernel: jax.nn." \
           "dot_product_attention(implementation='cudnn') refused it: cuDNN is not detected" \
           in caplog.text


def _bf16_lm(family: str, implementation: str, **model) -> tuple[LanguageModelTrainer, dict]:
  """A bfloat16 LM (64 wide, heads 8 wide; llama with 2 key/value heads; `model`'s fields)
  on one device under the blockwise method with `implementation`, and a batch of unpacked
  rows."""
  config = tiny_lm_config("data_parallel", **{"model.family": family, "model.embed_dim": 64,
                                              "model.head_dim": 8})
  config.model.update(num_kv_heads=2 if family == "llama" else config.model.num_kv_heads,
                      **model)
  config.strategy.name = "single_device"
  config.mixed_precision.compute_dtype = "bfloat16"
  config.attention.update(method="blockwise", block_size=4, implementation=implementation)
  tokens = np.random.default_rng(0).integers(0, 32, (16, 16)).astype(np.int32)
  return LanguageModelTrainer(config), {"inputs": tokens, "targets": np.roll(tokens, -1, axis=1)}


@pytest.mark.parametrize("family,window", [("transformer", None), ("llama", 8)])
def test_under_cudnn_an_lm_step_lowers_for_cuda_with_its_mask_window_and_scale(family, window,
                                                                            monkeypatch):
  """The bfloat16 step under `implementation='cudnn'`, lowered for CUDA on this machine: jax's
  cuDNN rule takes every call (its head width, layout, grouped heads and window checks run
  here; the GPU's cuDNN version and compute capability are stood in for: 9.10, Hopper), and
  its forward and backward kernels get the step's causal mask, window and scale."""
  fused_attention = importlib.import_module("jax._src.cudnn.fused_attention_stablehlo")
  monkeypatch.setattr(fused_attention, "check_cudnn_version", lambda: 91000)
  monkeypatch.setattr(fused_attention, "check_compute_capability", lambda capability: True)
  monkeypatch.setattr(fused_attention, "is_cuda_compute_capability_equal", lambda c: False)
  monkeypatch.setattr(attention_lib, "_backend", lambda: "gpu")
  trainer, batch = _bf16_lm(family, "cudnn", **({"sliding_window": window} if window else {}))
  state = trainer.init_state(batch)
  lowered = trainer.compiled.train(state).trace(state, trainer.strategy.put_batch(batch)).lower(
      lowering_platforms=("cuda",))
  calls = [line for line in lowered.as_text().splitlines() if "__cudnn$fmha" in line]
  kernels = sorted(re.search(r"__cudnn\$(fmha\w+)", c).group(1) for c in calls)
  assert kernels == ["fmhaSoftmax", "fmhaSoftmaxBackward"], kernels  # The layers' scan body.
  for call in calls:
    config_text = call.replace("\\22", '"')
    assert '"mask_type": "CAUSAL"' in config_text
    assert f'"sliding_window_length": {window or 0},' in config_text
    scale = float(re.search(r'"fmha_scale": ([\d.e-]+)', config_text).group(1))
    assert scale == pytest.approx(8 ** -0.5, rel=1e-12)


@pytest.mark.parametrize("family", ["transformer", "gpt2", "llama"])
def test_on_a_gpu_every_attention_call_of_an_unpacked_lm_step_can_run_as_cudnn(family,
                                                                                monkeypatch):
  """A bfloat16 LM step on unpacked rows, under `implementation='cudnn'` with the backend a
  GPU: every attention call of the step reaches the fused kernel (here jax's XLA
  implementation of that call stands in for cuDNN), and the step's loss is the one of XLA's
  blockwise schedule to bfloat16's precision. (A model that filled in segment ids for
  unpacked rows would be refused, as the three did: segment_ids; so would one whose
  layers ran in float32 under bfloat16 compute, as the NNX Llama's did: its embedding
  lookup gave float32.)"""
  monkeypatch.setattr(attention_lib, "_backend", lambda: "gpu")
  fused = attention_lib._fused
  asked = []
  monkeypatch.setattr(attention_lib, "_fused", lambda block, q, k, v, implementation: (
      asked.append(implementation) or fused(block, q, k, v, None)))
  losses = {}
  for implementation in ("cudnn", "xla"):
    trainer, batch = _bf16_lm(family, implementation)
    state = trainer.init_state(batch)
    assert asked == []  # The init traces in float32, by XLA's schedule.
    _, metrics = trainer.compiled.train(state)(state, trainer.strategy.put_batch(batch))
    losses[implementation] = float(metrics["metrics"].compute()["loss"])
    # Under 'cudnn' a call the kernel could not take would have been refused.
    assert asked == [] if implementation == "xla" else asked and set(asked) == {"cudnn"}, asked
    asked.clear()
  np.testing.assert_allclose(losses["cudnn"], losses["xla"], rtol=2 ** -7)
