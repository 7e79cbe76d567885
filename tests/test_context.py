"""Context parallelism (all-gather and ring attention) and packed sequences, equal to one device.

The transformer LM under every context layout of `configs/lm.py` is in
`test_transformer.py` (its layout test covers them); here: GPT-2 with dropout,
Llama with grouped-query attention and rotary positions, and a user's NNX decoder,
each against one device (logits, and parameters after 3 steps within the chaos
yardstick); packing; the refusals.
"""

import itertools

import jax
import jax.numpy as jnp
import numerics
import numpy as np
import pytest
from small_configs import tiny_lm_config
from user_models import SharedAttentionDecoderTrainer, StackedDecoderTrainer

from models.attention import attention
from strategies import context as context_lib
from strategies.context import ContextError
from trainer.data import packing
from trainer.language_model import LanguageModelTrainer, synthetic_token_batches

STEPS = 3
FAMILIES = {
    "gpt2": dict(head_dim=None, dropout_rate=0.1),  # Residual, embedding, attention dropout.
    "llama": dict(head_dim=None, num_kv_heads=2),  # 8 query heads read 2 key/value heads.
    "user": {},  # tests/user_models.py:SharedAttentionDecoder, with dropout.
}


class DropoutDecoderTrainer(SharedAttentionDecoderTrainer):
  dropout = 0.1


def _config(layout="data_parallel", family="transformer", **overrides):
  config = tiny_lm_config(layout, **overrides)
  if family != "user":
    config.model.family = family
    config.model.update(FAMILIES.get(family, {}))
  return config


def _trainer(config, family):
  return (DropoutDecoderTrainer if family == "user" else LanguageModelTrainer)(config)


def _batches(config, num=STEPS + 1):
  return list(itertools.islice(synthetic_token_batches(
      config.seed, config.batch_size, config.seq_len, config.model.vocab_size), num))


_REFERENCES = {}


def _reference(family):
  """One device: the logits of the first batch, the parameters after 3 steps, chaos runs."""
  if family not in _REFERENCES:
    config = _config(family=family, **{"strategy.name": "single_device"})
    trainer = _trainer(config, family)
    batches = _batches(config)
    state = trainer.init_state(batches[0])
    logits = trainer.predict(state, batches[STEPS])
    state = trainer.fit(batches[:STEPS], num_steps=STEPS, state=state).state
    chaos = numerics.chaos_fits(trainer, batches[:STEPS], num_steps=STEPS,
                                view=lambda s: jax.device_get(s.params))
    _REFERENCES[family] = logits, jax.device_get(state.params), chaos
  return _REFERENCES[family]


# Every family under each context layout and method; where a family has dropout, the
# sequence is in its plain order (a load-balanced order reorders the residual dropout's
# masks along with the tokens; the attention weights' masks follow the tokens' places).
PLAIN = {"load_balance": False}
CASES = [  # Data x context and FSDP for the transformer: tests/test_transformer.py.
    ("gpt2", "context_ring", PLAIN),
    ("gpt2", "context_tensor", {"method": "ring", **PLAIN}),
    ("llama", "context", {}),
    ("llama", "context_tensor", {"method": "ring"}),
    ("llama", "context_fsdp", {"method": "ring", **PLAIN}),
    ("user", "context_ring", PLAIN),
]


@pytest.mark.parametrize("family,layout,fields", CASES,
                         ids=[f"{f}-{layout}-{'-'.join(map(str, c.values())) or 'default'}"
                              for f, layout, c in CASES])
def test_context_parallel_equals_one_device(family, layout, fields):
  _equals_one_device(family, layout, fields)


BLOCKWISE = [("gpt2", "context_ring", PLAIN), ("llama", "context", {})]


@pytest.mark.parametrize("family,layout,fields", BLOCKWISE,
                         ids=[f"{f}-{layout}-{'-'.join(map(str, c.values())) or 'default'}"
                              for f, layout, c in BLOCKWISE])
def test_blockwise_attention_under_a_context_axis_equals_one_device(family, layout, fields):
  """`config.attention.method='blockwise'` under a context axis: each chunk of keys a device
  attends to (all-gathered, or the ring's held block) is folded in by blocks of 1 query
  and key, blockwise attention's own `_fold`; logits and 3 steps equal one device's."""
  _equals_one_device(family, layout, fields, attention=dict(method="blockwise", block_size=1))


def _equals_one_device(family, layout, fields, attention=None):
  want_logits, want_params, chaos = _reference(family)
  config = _config(layout, family)
  config.strategy.context.update(fields)
  if attention:
    config.attention.update(attention)
  trainer = _trainer(config, family)
  assert trainer.strategy.context is not None
  batches = _batches(config)
  state = trainer.init_state(batches[0])
  np.testing.assert_allclose(trainer.predict(state, batches[STEPS]), want_logits, atol=1e-5)
  state = trainer.fit(batches[:STEPS], num_steps=STEPS, state=state).state
  numerics.assert_equivalent(jax.device_get(state.params), want_params, chaos)


def test_the_load_balanced_order_gives_each_device_an_early_and_a_late_chunk():
  plan = context_lib.ContextPlan(size=4, method="all_gather", load_balance=True)
  order = plan.order(16).reshape(4, 4)  # Device i's 4 tokens: chunks i and 7 - i.
  np.testing.assert_array_equal(order[0], [0, 1, 14, 15])
  np.testing.assert_array_equal(order[3], [6, 7, 8, 9])
  assert sorted(plan.order(16)) == list(range(16))
  # Causal work per device (keys before each query) is equal.
  work = [int(sum(q + 1 for q in row)) for row in order]
  assert len(set(work)) == 1, work
  plain = context_lib.ContextPlan(size=4, method="ring", load_balance=False)
  np.testing.assert_array_equal(plain.order(16), np.arange(16))


# -- Packed sequences ----------------------------------------------------------------------

DOCS = [list(np.random.default_rng(i).integers(1, 32, size=n)) for i, n in
        enumerate([5, 9, 3, 12, 4, 7, 2, 16, 6, 10, 8, 5, 11, 3, 9, 4, 13, 6, 7, 5])]


def _packed(config, num=1):
  return list(itertools.islice(packing.packed_batches(
      DOCS, length=config.seq_len, batch_size=config.batch_size, seed=0), num))


def _token_loss(probs, batch):
  p = np.take_along_axis(np.asarray(probs), np.asarray(batch["targets"])[..., None], -1)
  return -np.log(p[..., 0])


@pytest.mark.parametrize("family", ["transformer", "gpt2", "llama"])
def test_packed_documents_have_the_losses_they_have_alone(family):
  config = _config(family=family, **{"strategy.name": "single_device"})
  trainer = LanguageModelTrainer(config)
  batch = _packed(config)[0]
  packing.check_packed(batch)
  assert (batch["segment_ids"].max(axis=1) >= 2).any()  # Rows hold several documents.
  state = trainer.init_state(batch)
  packed = _token_loss(trainer.predict(state, batch), batch)
  # Each document alone, at the start of its own row (the rest of the row after it).
  seg, pos = batch["segment_ids"], batch["positions"]
  pieces = [(r, np.flatnonzero(seg[r] == s)) for r in range(len(seg))
            for s in range(1, seg[r].max() + 1)]
  alone = {k: np.zeros((len(pieces), config.seq_len), np.int32) for k in ("inputs", "targets")}
  for i, (r, cols) in enumerate(pieces):
    assert (pos[r, cols] == np.arange(len(cols))).all()
    for k in alone:
      alone[k][i, :len(cols)] = batch[k][r, cols]
  rows = -(-len(pieces) // config.batch_size) * config.batch_size
  alone = {k: np.pad(v, ((0, rows - len(v)), (0, 0))) for k, v in alone.items()}
  single = np.concatenate([_token_loss(trainer.predict(state, {k: v[i:i + config.batch_size]
                                                              for k, v in alone.items()}),
                                       {"targets": alone["targets"][i:i + config.batch_size]})
                           for i in range(0, rows, config.batch_size)])
  for i, (r, cols) in enumerate(pieces):
    np.testing.assert_allclose(packed[r, cols], single[i, :len(cols)], rtol=1e-5, atol=1e-6)
  # The loss counts only the real tokens: the padding's targets do not move it.
  real = seg > 0
  per_row = (packed * real).sum(1) / real.sum(1)
  outputs = trainer.steps.eval_outputs(state, trainer.strategy.put_batch(batch))
  np.testing.assert_allclose(trainer.loss(outputs, batch), per_row, rtol=1e-5)
  padded = dict(batch, targets=np.where(real, batch["targets"], 7))
  np.testing.assert_allclose(trainer.loss(outputs, padded), per_row, rtol=1e-5)


@pytest.mark.parametrize("layout,fields", [("context", {}),
                                           ("data_context", {"method": "ring"}),
                                           ("pipeline", {})])
def test_packed_batches_under_context_parallelism_and_the_pipeline(layout, fields):
  config = _config(layout)
  single = _config(**{"strategy.name": "single_device",
                      "model.num_layers": config.model.num_layers})
  config.strategy.context.update(fields)
  batches = _packed(config, STEPS + 1)
  reference = LanguageModelTrainer(single)
  trainer = LanguageModelTrainer(config)
  want = reference.predict(reference.init_state(batches[0]), batches[STEPS])
  state = trainer.init_state(batches[0])
  np.testing.assert_allclose(trainer.predict(state, batches[STEPS]), want, atol=1e-5)
  if layout == "data_context":  # And it trains as one device does on packed rows.
    ref = reference.fit(batches[:STEPS], num_steps=STEPS).state
    chaos = numerics.chaos_fits(reference, batches[:STEPS], num_steps=STEPS,
                                view=lambda s: jax.device_get(s.params))
    got = trainer.fit(batches[:STEPS], num_steps=STEPS, state=state).state
    numerics.assert_equivalent(jax.device_get(got.params), jax.device_get(ref.params), chaos)


def _bad(batch, **changes):
  out = {k: np.array(v) for k, v in batch.items()}
  for key, (row, col, value) in changes.items():
    out[key][row, col] = value
  return out


def test_bad_segment_ids_are_refused_before_the_step():
  config = _config(**{"strategy.name": "single_device"})
  batch = _packed(config)[0]
  row = int(np.argmax(batch["segment_ids"].max(1)))  # A row with several documents.
  last = int(np.flatnonzero(batch["segment_ids"][row] > 0)[-1])
  cases = [
      (_bad(batch, segment_ids=(row, last, 1)), "decreases from"),
      (_bad(batch, segment_ids=(row, 0, -1)), "segment ids are 0 \\(padding\\) or 1..16"),
      (_bad(batch, segment_ids=(row, 0, 99)), "holds 99 at position 0"),
      (_bad(batch, positions=(row, 1, 5)), "positions count from 0"),
  ]
  if last + 1 < config.seq_len:
    cases.append((_bad(batch, segment_ids=(row, last, 0)), "padding \\(0\\) before"))
  for bad, message in cases:
    with pytest.raises(packing.PackingError, match=message):
      packing.check_packed(bad)
  trainer = LanguageModelTrainer(config)
  state = trainer.init_state(batch)
  with pytest.raises(packing.PackingError, match=f"train batch for step 0.*row {row}"):
    trainer.fit([cases[0][0]], num_steps=1, state=state)
  long = _config(**{"strategy.name": "single_device", "seq_len": 32})
  with pytest.raises(ValueError, match=r"the batch's rows hold 32 tokens .* more than the "
                     r"model's max_len=16 \(config.model.max_len\)"):
    LanguageModelTrainer(long).init_state(_packed(long)[0])


# -- Refusals ------------------------------------------------------------------------------


def test_a_length_that_does_not_split_is_refused_naming_the_field():
  config = _config("context", **{"seq_len": 12, "model.max_len": 16})
  with pytest.raises(ContextError, match=r"the batch's sequence length 12 \(the length of "
                     r"its rows\) does not split into 2 x context = 16 equal chunks"):
    LanguageModelTrainer(config).init_state(_batches(config, 1)[0])
  config.strategy.context.update(method="ring", load_balance=False)  # 8 blocks: not 12.
  with pytest.raises(ContextError, match="context = 8 equal blocks"):
    LanguageModelTrainer(config).init_state(_batches(config, 1)[0])


def test_context_under_an_ensemble_is_refused():
  config = _config(**{"strategy.name": "sharded_ensemble", "ensemble_size": 2})
  config.strategy.context.method = "ring"
  with pytest.raises(ContextError, match=r"config.strategy.context.method='ring' asks for "
                                         r"context parallelism, but config.strategy.name="
                                         r"'sharded_ensemble' trains an ensemble"):
    LanguageModelTrainer(config)


def test_attention_the_model_wrote_itself_is_refused_under_a_context_axis():
  config = _config("context")
  trainer = StackedDecoderTrainer(config)  # nnx.dot_product_attention, by hand.
  batches = _batches(config, 1)
  state = trainer.init_state(batches[0])
  with pytest.raises(ContextError, match="never called models.attention.attention"):
    trainer.fit(batches, num_steps=1, state=state)


def test_a_mask_array_is_refused_under_a_context_axis_and_honoured_without_one():
  q = jax.random.normal(jax.random.key(0), (2, 16, 4, 8))
  mask = jnp.tril(jnp.ones((16, 16), bool))[None, None]
  # Plain: a causal mask array is the causal flag.
  np.testing.assert_allclose(attention(q, q, q, causal=False, mask=mask),
                             attention(q, q, q), atol=1e-6)
  plan = context_lib.ContextPlan(size=8, method="ring", load_balance=False)
  with context_lib.active(plan), pytest.raises(ContextError, match=r"attention\(mask=...\) "
                                                                   r"under the 'context'"):
    attention(q, q, q, mask=mask)


def test_context_fields_without_a_context_axis_are_refused():
  config = _config("data_parallel")
  config.strategy.context.method = "ring"
  with pytest.raises(ContextError, match="no 'context' axis"):
    LanguageModelTrainer(config)
  config = _config("context")
  config.strategy.context.method = "scatter"
  with pytest.raises(ContextError, match=r"method='scatter' is not one of \('all_gather', "
                                         r"'ring'\)"):
    LanguageModelTrainer(config)


# -- What it buys ----------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["all_gather", "ring"])
def test_the_dry_run_shows_temporaries_per_device_falling_with_the_context_size(method):
  from strategies import ShardedDataParallel
  from trainer.plan import make_plan

  plans = {}
  for size in (1, 4):
    config = _config("context", **{"seq_len": 512, "model.max_len": 512, "batch_size": 1})
    config.strategy.context.method = method
    strategy = ShardedDataParallel((1, size), ("data", "context"),
                                   config.strategy.logical_axis_rules,
                                   devices=jax.devices()[:size],
                                   context=context_lib.config_fields(config))
    trainer = LanguageModelTrainer(config, strategy=strategy)
    plans[size] = make_plan(trainer, _batches(config, 1)[0])
  assert f"attention by {method}" in plans[4].strategy
  # A quarter of every activation and of the scores per device, plus what does not split.
  assert plans[4].temp_bytes < plans[1].temp_bytes / 2.5, (plans[1].temp_bytes,
                                                          plans[4].temp_bytes)
  moved = plans[4].collective_bytes
  if method == "ring":  # Keys and values passed on, and their gradients back.
    assert plans[4].collectives["collective-permute"] >= 4
    assert moved["collective-permute"] > 0
  else:
    assert moved["all-gather"] > 0
