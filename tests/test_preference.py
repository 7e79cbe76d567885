"""Preference training's parts (`trainer.preference`): the pairs as rows, bad records, the
reference policy's three forms, a sweep over beta, and refusals before any compute.

The model is a 1-layer `transformer` LM of width 32 on a byte-level BPE with a chat
template (`preference_files`); equality with TRL is `test_preference_trl.py`'s.
"""

import json
import os

import jax
import ml_collections
import numpy as np
import preference_files as pf
import pytest

from configs import preference
from strategies.sharded_ensemble import held_once
from trainer.data.records import CorpusError
from trainer.preference import PreferenceTrainer
from trainer.preference import data as pdata
from trainer.preference import reference as reference_lib

SEQ_LEN = 64


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  root = tmp_path_factory.mktemp("preference")
  tokenizer = pf.write_tokenizer(root / "tokenizer", add_bos=True)
  return {"tokenizer": tokenizer, "root": root,
          "text": pf.write_jsonl(root / "text.jsonl", pf.text_pairs(40)),
          "chat": pf.write_jsonl(root / "chat.jsonl", pf.chat_pairs(40))}


def tiny_config(files, *, source="text", variant="dpo", **overrides):
  config = preference.get_config(variant)
  config.model = ml_collections.ConfigDict(dict(
      family="transformer", vocab_size=pf.VOCAB, num_layers=1, embed_dim=32, num_heads=4,
      head_dim=8, mlp_dim=64, max_len=SEQ_LEN, vocab_multiple=None))
  config.data.update(sources=(str(files[source]),), tokenizer=str(files["tokenizer"]),
                     workers=0, shuffle_files=False, lanes=1)
  config.update(seq_len=SEQ_LEN, batch_size=8, eval_batch_size=8, num_train_steps=4,
                log_every_steps=1000)
  config.schedule.warmup_steps = 0
  if variant in ("lora", "qlora"):
    config.lora.targets = (".*/w[io]/kernel",)
  config.update_from_flattened_dict(overrides)
  return config


# -- The pairs as rows --------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["text", "chat"])
def test_each_row_holds_its_pair_and_every_response_target(files, kind):
  """For both sequences of every row: the inputs and targets are the prompt and response's
  tokens shifted by one, the weights mark exactly the response's targets, and a text
  response decodes to the record's response and EOS."""
  config = tiny_config(files, source=kind)
  corpus = pdata.from_config(config, epochs=1)
  encoder = corpus.encode
  records = [json.loads(line) for line in open(files[kind])]
  rows = [row for batch in corpus() for row in zip(*(batch[k] for k in (
      "inputs", "targets", pdata.LOSS_WEIGHTS, pdata.TARGET_MASK,
      pdata.COMPLETION_TOKENS)), strict=True)]
  assert len(rows) == 40  # One epoch: every record once, in order (one lane, files in order).
  for record, (inputs, targets, weights, mask, counts) in zip(records, rows, strict=True):
    kind_, (prompt, *responses) = encoder.tokenize(record)
    assert kind_ is None
    for i, response in enumerate(responses):
      sequence = prompt + response
      n = len(sequence) - 1
      assert inputs[i, :n].tolist() == sequence[:-1]
      assert targets[i, :n].tolist() == sequence[1:]
      assert mask[i].tolist() == [1.0] * n + [0.0] * (SEQ_LEN - n)
      assert np.flatnonzero(weights[i]).tolist() == list(range(len(prompt) - 1, n))
      assert counts[i] == len(response)
      if kind == "text":
        side = ("chosen", "rejected")[i]
        assert corpus.tokenizer.tokenizer.decode(response, skip_special_tokens=False) == (
            record[side] + pf.EOS)


def test_bad_records_are_named_or_skipped_and_counted(files, tmp_path):
  good = pf.text_pairs(8)
  long = {"prompt": "the cat", "chosen": " sat" * 80, "rejected": " ran"}
  bad = [{"prompt": "a", "chosen": "b"}, {**good[0], "chosen": "  "}, long]
  path = pf.write_jsonl(tmp_path / "bad.jsonl", good[:4] + bad + good[4:])  # Lines 5-7.
  config = tiny_config(files, **{"preference.truncation": "refuse"})
  config.data.sources = (str(path),)
  reads = pdata.from_config(config, epochs=1)()
  with pytest.raises(CorpusError, match=rf"{path}: line 5 has no 'rejected' field \(its "
                                        rf"fields: 'prompt', 'chosen'\); a pair is text"):
    list(reads)
  config.data.bad_records = "skip"
  reads = pdata.from_config(config, epochs=1)()
  assert sum(len(b["inputs"]) for b in reads) == 8
  assert {k: v for k, v in reads.skipped().items() if v} == {
      "missing_pair": 1, "empty_response": 1, "too_long": 1}
  config.preference.truncation = "keep_start"  # The long pair is cut at its end instead.
  rows = list(pdata.from_config(config, epochs=1)())
  assert sum(len(b["inputs"]) for b in rows) == 8  # 8 good + the cut one = 9: one short row.
  cut = pdata.encoder(config, pdata.from_config(config).tokenizer)(long)[1][0]
  assert cut[pdata.TARGET_MASK][0].sum() == SEQ_LEN  # Its chosen sequence fills the row.
  assert cut[pdata.COMPLETION_TOKENS][0] == SEQ_LEN + 1 - len(
      pdata.encoder(config, pdata.from_config(config).tokenizer).tokenize(long)[1][0])


def test_parquet_pairs_are_the_jsonl_pairs(files, tmp_path):
  import pyarrow as pa
  import pyarrow.parquet as pq
  records = pf.text_pairs(16)
  jsonl = pf.write_jsonl(tmp_path / "p.jsonl", records)
  parquet = tmp_path / "p.parquet"
  pq.write_table(pa.Table.from_pylist(records), parquet, row_group_size=5)
  batches = {}
  for path in (jsonl, parquet):
    config = tiny_config(files)
    config.data.sources = (str(path),)
    batches[path.suffix] = list(pdata.from_config(config, epochs=1)())
  for a, b in zip(batches[".jsonl"], batches[".parquet"], strict=True):
    for key in a:
      np.testing.assert_array_equal(a[key], b[key])


def test_the_stream_resumes_exactly_on_any_process_count(files):
  config = tiny_config(files, **{"data.lanes": 4})
  straight = pdata.from_config(config)()
  expected = [next(straight) for _ in range(6)]
  first = pdata.from_config(config)()
  for _ in range(3):
    next(first)
  position = first.get_state()
  for rows in (slice(0, 8), slice(0, 4), slice(4, 8)):  # One process, or two.
    resumed = pdata.from_config(config, rows)()
    resumed.set_state(position)
    for batch in expected[3:]:
      got = next(resumed)
      for key in batch:
        np.testing.assert_array_equal(got[key], batch[key][rows])


# -- The reference ----------------------------------------------------------------------


def batch_of(config):
  return next(pdata.from_config(config)())


def logps(trainer, state, batch, params=None):
  """The policy's per-sequence response log-probs (`params`: instead of the state's)."""
  params = trainer.strategy.to_canonical(state).params if params is None else params
  model_state = trainer.strategy.to_canonical(state).model_state
  outputs, _ = jax.jit(lambda p: trainer.apply_model(
      p, model_state, batch, rngs=trainer.step_rngs(jax.random.PRNGKey(0)), train=False))(
          params)
  return np.asarray(outputs.token_logps * batch[pdata.LOSS_WEIGHTS]).sum(-1)


def test_the_copy_stays_the_initial_weights(files):
  config = tiny_config(files)
  trainer = PreferenceTrainer(config)
  start = trainer.init_state(batch_of(config))
  initial = jax.device_get(start.params)
  result = trainer.fit(lambda s: pdata.from_config(config)(s), num_steps=3, state=start)
  moved = jax.tree.map(lambda a, b: float(np.abs(a - b).max()), initial,
                       jax.device_get(result.state.params))
  assert max(jax.tree.leaves(moved)) > 0
  jax.tree.map(np.testing.assert_array_equal, initial,
               jax.device_get(result.state.reference))


def test_adapters_off_is_the_base_model(files):
  """Under LoRA the reference's log-probs are the base's whatever the adapters hold, and the
  policy's while B is zero; no copy of the weights is kept."""
  config = tiny_config(files, variant="lora")
  trainer = PreferenceTrainer(config)
  assert trainer.preference.reference == "adapters_off"
  batch = batch_of(config)
  state = trainer.init_state(batch)
  assert state.reference is None
  ref = trainer.reference_logps_fn(state)
  base = np.asarray(ref(state, trainer.strategy.put_batch(batch)))
  np.testing.assert_allclose(logps(trainer, state, batch), base, rtol=1e-6)

  def fill(path, x):  # Every adapter's B made nonzero: the policy is no longer the base.
    name = jax.tree_util.keystr(path)
    return x + 0.5 if name.endswith("_lora_b']") or "_lora_b'" in name else x
  moved = state.replace(params=jax.tree_util.tree_map_with_path(fill, state.params))
  assert not np.allclose(logps(trainer, moved, batch), base, atol=1e-3)
  np.testing.assert_allclose(np.asarray(ref(moved, trainer.strategy.put_batch(batch))), base,
                             rtol=1e-6)


def test_precomputed_trains_as_the_copy_and_a_resume_reads_its_table(files, tmp_path):
  from trainer.checkpoint import Checkpointer

  def run(reference, workdir, steps):
    config = tiny_config(files, **{"preference.reference": reference})
    trainer = PreferenceTrainer(config)
    stream = pdata.from_config(config)
    checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"), every_steps=0,
                                async_save=False)
    fresh = checkpointer.latest_step() is None
    state = trainer.init_state(next(stream()))  # A resume reads the table, not this state.
    stream, _ = trainer.precompute_reference(state, stream, num_steps=config.num_train_steps,
                                             workdir=workdir)
    result = trainer.fit(stream, num_steps=steps, checkpointer=checkpointer,
                         state=state if fresh else None)
    checkpointer.close()
    return jax.device_get(result.state.params)

  copy = run("copy", str(tmp_path / "copy"), 4)
  workdir = str(tmp_path / "stored")
  run("precomputed", workdir, 2)
  table = os.path.join(workdir, reference_lib.STORED_FILE)
  written = os.stat(table).st_mtime_ns
  stored = run("precomputed", workdir, 4)  # Resumed at step 2.
  assert os.stat(table).st_mtime_ns == written
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), stored,
               copy)


# -- A sweep over beta --------------------------------------------------------------------


def test_a_sweep_over_beta_trains_each_member_as_its_own_run(files):
  config = tiny_config(files, variant="sweep", **{"strategy.ensemble_mesh_shape": (2, -1)})
  config.sweep.grid.beta = (0.1, 0.5)
  trainer = PreferenceTrainer(config)
  stream = pdata.from_config(config)
  swept = trainer.fit(stream, num_steps=2)
  # The copy reference (of the one seed's weights) is held once for both members.
  assert all(held_once(x) for x in jax.tree.leaves(swept.state.reference))
  members = jax.device_get(trainer.strategy.to_canonical(swept.state).params)
  for i, beta in enumerate((0.1, 0.5)):
    single = tiny_config(files, **{"preference.beta": beta})
    result = PreferenceTrainer(single).fit(pdata.from_config(single), num_steps=2)
    jax.tree.map(lambda m, s, i=i: np.testing.assert_allclose(m[i], s, rtol=2e-5, atol=1e-6),
                 members, jax.device_get(result.state.params))


# -- Refused before any compute -----------------------------------------------------------


@pytest.mark.parametrize("overrides,match", [
    ({"preference.beta": 0.0}, r"config\.preference\.beta=0\.0 must be a number > 0"),
    ({"preference.beta": -0.1}, r"config\.preference\.beta=-0\.1 must be a number > 0"),
    ({"preference.loss": "kto"}, r"config\.preference\.loss='kto' is not one of \('sigmoid'"),
    ({"preference.reference": "adapters_off"},
     r"config\.preference\.reference='adapters_off' needs LoRA adapters"),
    ({"preference.reference": "frozen"}, r"config\.preference\.reference='frozen' is not one"),
    ({"preference.truncation": "middle"}, r"config\.preference\.truncation='middle' is not"),
    ({"strategy.mesh_axes": ("data", "stage"), "strategy.mesh_shape": (2, -1)},
     r"does not run under a pipeline"),
    ({"data.chat": True}, r"config\.data\.chat=True with config\.preference"),
])
def test_refused_naming_the_field_before_any_compute(files, overrides, match):
  config = tiny_config(files, **overrides)
  with pytest.raises(ValueError, match=match):
    PreferenceTrainer(config)


def test_a_copy_of_a_quantized_base_is_refused(files):
  config = tiny_config(files, variant="qlora", **{"preference.reference": "copy"})
  with pytest.raises(ValueError, match=r"reference='copy' with a quantized base"):
    PreferenceTrainer(config)


def test_the_metrics_agree_with_each_other(files):
  config = tiny_config(files, source="chat")
  trainer = PreferenceTrainer(config)
  batches = list(pdata.from_config(config, epochs=1)())[:2]
  result = trainer.fit(lambda s: pdata.from_config(config)(s), num_steps=2)
  values = trainer.evaluate(result.state, batches)
  assert set(values) >= {"loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies",
                         "rewards/margins", "logps/chosen", "logps/rejected"}
  np.testing.assert_allclose(values["rewards/margins"],
                             values["rewards/chosen"] - values["rewards/rejected"], rtol=1e-5)
  assert 0.0 <= values["rewards/accuracies"] <= 1.0
  assert values["logps/chosen"] < 0 and values["logps/rejected"] < 0


def test_harness_tasks_run_on_the_policy_during_preference_training(files, monkeypatch):
  """`trainer.harness.HarnessEval` as an action of a DPO run: the example tasks scored on
  the policy in its layout, and a generation, at the run's end."""
  pytest.importorskip("lm_eval")
  from recorder import Recorder

  from trainer.harness import HarnessEval

  config = tiny_config(files, **{"preference.loss": "simpo"})
  trainer = PreferenceTrainer(config)
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  monkeypatch.chdir(root)  # The tasks' data files are relative to the repository's root.
  sink = Recorder()
  action = HarnessEval(trainer, sink, ["docs_choice"], every_steps=100,
                       tokenizer=str(files["tokenizer"] / "tokenizer.json"),
                       include_path=os.path.join(root, "examples", "harness_tasks"),
                       builtin_tasks=False, prompts=["the cat"], max_new_tokens=4)
  trainer.fit(pdata.from_config(config), num_steps=2, actions=[action])
  assert 0.0 <= sink.latest("harness/docs_choice/acc") <= 1.0
  assert sink.latest("harness/generations").startswith("'the cat' -> ")
