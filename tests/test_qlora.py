"""QLoRA (`config.lora.base_dtype`): a LoRA run whose frozen base is stored quantized.

A step's logits equal the plain model's whose weights are the base dequantized by
hand here (the NF4 table of the QLoRA paper, or int8 values, times each block's
scale) plus `alpha/r A@B`; the codes never change and have no optimizer state;
checkpoints hold 4-bit codes two per byte and restore them bitwise; the dry run
counts them at half a byte (NF4 with its scales at most 0.3x the weights' bf16
bytes); what cannot work is refused before compute, naming the field.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from small_configs import tiny_lm_config
from test_lora import ALPHA, GPT2, LLAMA, LLAMA_TARGETS, RANK, RNGS, TARGETS, _nest, _stream

from trainer.checkpoint import Checkpointer
from trainer.checkpoint.init_from import _flatten
from trainer.language_model import LanguageModelTrainer
from trainer.plan import make_plan

#: NF4's 16 values (Dettmers et al. 2023, appendix E): code i means NF4[i] times the scale.
NF4 = np.array([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
                -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
                0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
                0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                0.7229568362236023, 1.0])


def _config(layout, family, base_dtype, block_size, **overrides):
  config = tiny_lm_config(layout, learning_rate=3e-2, **overrides)
  config.model = ml_collections.ConfigDict(GPT2 if family == "gpt2" else LLAMA)
  if layout.startswith("pipeline"):
    config.model.num_layers = 4
  config.lora.update(rank=RANK, alpha=ALPHA, targets=TARGETS if family == "gpt2" else
                     LLAMA_TARGETS, base_dtype=base_dtype, block_size=block_size)
  return config


def _layers(config, layout):
  """`config` with the layer count a run under `layout` has."""
  if layout.startswith("pipeline"):
    config.model.num_layers = 4
  return config


def _host(params):
  """`{path: array}` of canonical parameters, a quantized weight as `<w>/array/qvalue` and
  `<w>/array/scale`."""
  return {k: np.asarray(v) for k, v in _flatten(nn.meta.unbox(params)).items()}


def _by_hand(values, base_dtype):
  """The float weights: each quantized one's codes looked up (NF4) or taken (int8), times its
  scale repeated over the block it covers."""
  out = {}
  for path, x in values.items():
    if path.endswith("/array/scale"):
      continue
    if not path.endswith("/array/qvalue"):
      out[path] = x
      continue
    weight = path[:-len("/array/qvalue")]
    scale = values[weight + "/array/scale"].astype(np.float64)
    codes = x.astype(np.int64)
    levels = NF4[codes] if base_dtype == "nf4" else codes.astype(np.float64)
    for axis, (n, k) in enumerate(zip(codes.shape, scale.shape, strict=True)):
      scale = np.repeat(scale, n // k, axis=axis)
    out[weight] = (levels * scale).astype(np.float32)
  return out


CASES = {"gpt2-nf4": ("data_parallel", "gpt2", "nf4", 8),
         "llama-nf4": ("fsdp", "llama", "nf4", 4),
         "gpt2-int8-pipeline": ("pipeline", "gpt2", "int8", 8),
         "llama-nf4-pipeline": ("pipeline", "llama", "nf4", 8),
         "gpt2-bfloat16": ("data_parallel", "gpt2", "bfloat16", 8)}


@pytest.fixture(scope="module", params=list(CASES))
def trained(request):
  """A QLoRA run of 2 steps: (case, trainer, final state, initial and final host params)."""
  layout, family, base_dtype, block = CASES[request.param]
  config = _config(layout, family, base_dtype, block)
  config.ema_decay = 0.5  # The average of a quantized base: its codes, as they are.
  trainer = LanguageModelTrainer(config)
  state = trainer.init_state(next(_stream(0)))
  before = _host(trainer.strategy.to_canonical(state).params)
  result = trainer.fit(_stream, num_steps=2, state=state)
  after = _host(trainer.strategy.to_canonical(result.state).params)
  return request.param, trainer, result.state, before, after


def test_the_base_is_stored_quantized_and_only_the_adapters_train(trained):
  case, trainer, state, before, after = trained
  _, family, base_dtype, _ = CASES[case]
  codes = sorted(p for p in after if p.endswith("/array/qvalue"))
  kernels = [p for p in _by_hand(after, base_dtype) if p.endswith("kernel")]
  heads = [p for p in kernels if p.endswith("head/kernel")]  # Kept in its own dtype.
  assert heads == ([] if family == "gpt2" else ["lm_head/kernel"])
  assert after[heads[0]].dtype == np.float32 if heads else True
  if base_dtype == "bfloat16":  # Cast, not quantized: the kernels are bfloat16 arrays.
    codes = [p for p in kernels if p not in heads and after[p].dtype.name == "bfloat16"]
  else:
    assert {str(after[p].dtype) for p in codes} == {"uint4" if base_dtype == "nf4" else "int8"}
  assert len(codes) == len(kernels) - len(heads) == (4 if family == "gpt2" else 7)
  adapters = sorted(p for p in after if "_lora_" in p)
  for path in after:  # Codes, scales and every other base weight stay bitwise.
    moved = not np.array_equal(after[path], before[path])
    assert moved == (path in adapters), path
  moments = [x.shape for x in jax.tree.leaves(trainer.strategy.to_canonical(state).opt_state)
             if np.ndim(x)]
  assert sorted(moments) == sorted(2 * [after[p].shape for p in adapters])  # Adam's m and v.
  average = _host(trainer.strategy.to_canonical(state).ema_params)
  for path in after:  # The average moved with the adapters; the base is the base.
    assert (path in adapters) != np.array_equal(average[path], after[path]), path


def test_a_step_computes_the_dequantized_base_plus_the_scaled_adapter_product(trained):
  """Under a pipeline the trained parameters are applied by the same model without one."""
  case, trainer, state, _, after = trained
  layout, family, base_dtype, block = CASES[case]
  params = jax.device_get(nn.meta.unbox(trainer.strategy.to_canonical(state).params))
  if layout.startswith("pipeline"):
    trainer = LanguageModelTrainer(_layers(_config("data_parallel", family, base_dtype, block),
                                           layout))
  tokens = next(_stream(7))["inputs"]
  ours = np.asarray(jax.jit(lambda p: trainer.model_variables.apply(
      p, {}, ((tokens,), {}), rngs=RNGS, train=False)[0])(params))
  weights = _by_hand(after, base_dtype)
  base = {p: x for p, x in weights.items() if "_lora_" not in p}
  by_hand = dict(base)
  for path in [p[:-len("_lora_a")] for p in weights if p.endswith("_lora_a")]:
    w, a, b = weights[path], weights[path + "_lora_a"], weights[path + "_lora_b"]
    delta = np.matmul(a.reshape(a.shape[0], -1, RANK).astype(np.float64),  # Per layer.
                      b.reshape(b.shape[0], RANK, -1))
    by_hand[path] = (w + ALPHA / RANK * delta.reshape(w.shape)).astype(np.float32)
  plain_config = _layers(_config("data_parallel", family, "", block), layout)
  plain_config.lora.update(rank=0, targets=())
  plain = LanguageModelTrainer(plain_config)
  apply = lambda tree: np.asarray(plain.model_variables.apply(  # noqa: E731
      jax.tree.map(jnp.asarray, _nest(tree)), {}, ((tokens,), {}), rngs=RNGS, train=False)[0])
  expected = apply(by_hand)
  # The same float32 products in another order (~1e-6 of logits of size ~1).
  np.testing.assert_allclose(ours, expected, atol=1e-5, rtol=1e-5)
  assert np.abs(expected - apply(base)).max() > 1e-4  # The adapters matter.


def test_checkpoints_hold_4bit_codes_two_per_byte_and_restore_bitwise(trained, tmp_path):
  """On disk an NF4 weight's codes are `uint8`, two per byte along the last even axis (int8
  codes as they are); restored, every parameter is bitwise what was saved."""
  case, trainer, state, _, after = trained
  checkpointer = Checkpointer(str(tmp_path / "checkpoints"), every_steps=1, async_save=False)
  checkpointer.save(2, trainer.strategy.to_canonical(state), trainer.strategy.checkpoint_layout())
  checkpointer.wait()
  saved = {p: (tuple(x.shape), str(x.dtype))
           for p, x in _flatten(checkpointer.saved_arrays(2)["params"]).items()}
  for path in (p for p in after if p.endswith("/array/qvalue")):
    shape = after[path].shape
    if CASES[case][2] == "nf4":
      axis = max(a for a, n in enumerate(shape) if n % 2 == 0)
      shape = shape[:axis] + (shape[axis] // 2,) + shape[axis + 1:]
    assert saved[path] == (shape, "uint8" if CASES[case][2] == "nf4" else "int8")
  target = trainer.strategy.checkpoint_target(trainer.states.abstract(next(_stream(0))))
  restored = _host(checkpointer.restore(2, target).params)
  checkpointer.close()
  assert sorted(restored) == sorted(after)
  for path, x in after.items():
    assert restored[path].dtype == x.dtype, path
    np.testing.assert_array_equal(restored[path].view(np.uint8) if x.dtype.itemsize == 1
                                  and "int4" in x.dtype.name else restored[path],
                                  x.view(np.uint8) if "int4" in x.dtype.name else x)


def test_the_dry_run_counts_4bit_codes_at_half_a_byte():
  """A model whose input axes take blocks of 64 (QLoRA's): NF4 codes with float32 scales are
  about 0.5 + 4/64 bytes a value, at most 0.3x the weights' 2 bytes in bf16; int8 with its
  scales about 0.53x."""
  model = dict(GPT2, embed_dim=128, num_heads=2, mlp_dim=256)
  ratios = {}
  for base_dtype in ("nf4", "int8"):
    config = _config("data_parallel", "gpt2", base_dtype, 64)
    config.model = ml_collections.ConfigDict(model)
    plan = make_plan(LanguageModelTrainer(config), next(_stream(0)))
    count, held, bf16 = plan.quantized
    assert count == 4
    values = 2 * 128 * (3 * 128 + 128 + 256 + 256)  # c_attn, c_proj, c_fc, mlp c_proj.
    per_value = 0.5 if base_dtype == "nf4" else 1
    # Per layer: c_attn [embed, 3, heads, kv] and the MLP's kernels a scale per 64 inputs
    # and output; the attention's c_proj [heads, kv, embed] one per kv block of 64 and
    # output, shared by the heads (Qwix tiles a product's last contracting axis).
    scales = 2 * (3 * 128 * 128 // 64 + 128 + 2 * 128 * 256 // 64) * 4
    assert (bf16, held) == (2 * values, values * per_value + scales)
    ratios[base_dtype] = held / bf16
    assert "quantized base" in plan.report()
  assert ratios["nf4"] <= 0.3 < ratios["int8"] < 0.55


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_what_cannot_work_is_refused_before_compute(family):
  def refused(match, **lora):
    config = _config("data_parallel", family, "nf4", 8)
    config.lora.update(**lora)
    with pytest.raises(ValueError, match=match):
      LanguageModelTrainer(config).init_state(next(_stream(0)))

  kernel = ("blocks/mlp/c_fc/kernel" if family == "gpt2"
            else "blocks/layers/mlp/down_proj/kernel")
  width = 32 if family == "gpt2" else 64
  refused(r"config.lora.block_size=7 must be an even", block_size=7)
  refused(rf"config.lora.block_size=6 does not divide {kernel}'s input dimension {width}",
          block_size=6, quantize=(kernel,))
  refused(r"config.lora.quantize matches \[.*_lora_b'\], which train", quantize=(".*",))
  refused(r"config.lora.base_dtype='fp4' is not a storage type.*'nf4', 'int8'",
          base_dtype="fp4")
  refused(r"config.lora.base_dtype='nf4' needs adapters", rank=0, targets=())
  refused(r"config.lora.quantize entry '.\*nothing' matches no parameter",
          quantize=(".*nothing",))
  norm = "blocks/ln_1/scale" if family == "gpt2" else "blocks/layers/input_layernorm/scale"
  refused(r"config.lora.quantize matches \['" + norm + r"'\], which no", quantize=(norm,))
