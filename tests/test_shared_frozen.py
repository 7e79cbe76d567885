"""Frozen parts held once in an ensemble (`trainer.run.shared`): a LoRA sweep over one base.

The base that `config.init_from` loads from a `transformers` Llama is held once, replicated,
while each member's adapters and optimizer state keep the member axis; the members train
bitwise as they do over stacked copies of the base, each ends where its own single run
ends, the dry run counts the base once, checkpoints hold it once (a resume continues and a
member restores alone), and what cannot be shared is refused before compute.
"""

import json
import pathlib
import subprocess
import sys

import jax
import numpy as np
import preference_files as pf
import pytest
from shared_setup import RATES, lora_config, stream
from sweep_run import killed_and_resumed

from strategies.sharded_ensemble import held_once
from trainer.checkpoint import Checkpointer, CheckpointError
from trainer.export import export_checkpoint
from trainer.language_model import LanguageModelTrainer
from trainer.plan import make_plan

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
  directory = tmp_path_factory.mktemp("shared") / "llama"
  pf.save_model("llama", directory, seed=2, jitter=0.2)
  return directory


def _leaves(tree):
  return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(tree)}


@pytest.fixture(scope="module")
def swept(base):
  """The sweep over one copy of the base and over stacked copies, 2 steps each."""
  out = {}
  for share in ("auto", "none"):
    trainer = LanguageModelTrainer(lora_config(base, **{"strategy.share_frozen": share}))
    state = trainer.fit(stream, num_steps=2).state
    out[share] = trainer, state
  return out


def test_the_base_is_held_once_and_the_adapters_per_member(swept):
  trainer, state = swept["auto"]
  leaves = _leaves(state.params)
  for path, x in leaves.items():
    if "_lora_" in path:  # Each member's adapters: the member axis, split over 'ensemble'.
      assert x.shape[0] == len(RATES) and not held_once(x), path
    else:  # One copy, replicated over the 8 devices; a single model's shape.
      assert held_once(x) and x.sharding.is_fully_replicated, path
      assert x.shape == _leaves(swept["none"][1].params)[path].shape[1:], path
  # No optimizer state for the base; what there is (SGD's learning rate) is per member.
  assert not any(held_once(x) for x in jax.tree.leaves(state.opt_state))
  # The host view gives every member the one copy.
  canonical = _leaves(trainer.strategy.to_canonical(state).params)
  assert all(x.shape[0] == len(RATES) for x in canonical.values())


def test_each_member_trains_as_over_stacked_copies_and_as_its_own_run(base, swept):
  shared = jax.device_get(swept["auto"][0].strategy.to_canonical(swept["auto"][1]).params)
  stacked = jax.device_get(swept["none"][0].strategy.to_canonical(swept["none"][1]).params)
  jax.tree.map(np.testing.assert_array_equal, shared, stacked)  # The same program's values.
  for i, rate in enumerate(RATES):
    single = LanguageModelTrainer(lora_config(base, rates=(), learning_rate=rate))
    result = jax.device_get(single.fit(stream, num_steps=2).state.params)
    # SGD: the members' difference is the gradients' float noise (rows over 4 devices).
    jax.tree.map(lambda m, s, i=i: np.testing.assert_allclose(m[i], s, rtol=1e-5, atol=1e-6),
                 shared, result)
  moved = [p for p, x in _leaves(shared).items() if "_lora_b" in p]
  assert moved and all(np.abs(_leaves(shared)[p][1]).max() > 0 for p in moved)


@pytest.mark.parametrize("loop", ["map", "vmap"])
def test_every_loop_over_a_devices_members_reads_the_one_copy(base, swept, loop):
  """The members a device holds, run as a `lax.map` loop or vectorised: the same training
  as the unrolled program over stacked copies (vmap batches the products: float noise)."""
  trainer = LanguageModelTrainer(lora_config(base, **{"strategy.ensemble_loop": loop,
                                                      "strategy.ensemble_mesh_shape": (1, -1)}))
  state = trainer.fit(stream, num_steps=2).state
  assert all(held_once(x) for p, x in _leaves(state.params).items() if "_lora_" not in p)
  stacked = swept["none"][0].strategy.to_canonical(swept["none"][1]).params
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
               jax.device_get(trainer.strategy.to_canonical(state).params),
               jax.device_get(stacked))


def test_a_qlora_sweep_holds_its_quantized_base_once(base):
  """An NF4 base (codes and scales) loaded from the Llama: held once, as the float base
  is, and the sweep trains as over stacked copies of it."""
  states = {}
  for share in ("auto", "none"):
    trainer = LanguageModelTrainer(lora_config(base, **{
        "lora.base_dtype": "nf4", "lora.block_size": 8, "strategy.share_frozen": share}))
    states[share] = trainer, trainer.fit(stream, num_steps=2).state
  quantized = [(p, x) for p, x in _leaves(states["auto"][1].params).items()
               if "qvalue" in p or "scale" in p and "proj" in p]
  assert quantized and all(held_once(x) for _, x in quantized)
  assert all(held_once(x) == ("_lora_" not in p)
             for p, x in _leaves(states["auto"][1].params).items())
  jax.tree.map(np.testing.assert_array_equal,
               *(jax.device_get(t.strategy.to_canonical(s).params) for t, s in states.values()))


def test_the_dry_run_counts_the_base_once(base):
  batch = next(stream(0))
  members = 8
  rates = tuple(1e-3 * (i + 1) for i in range(members))
  plans = {share: make_plan(LanguageModelTrainer(lora_config(
      base, rates=rates, **{"strategy.share_frozen": share,
                            "strategy.ensemble_mesh_shape": (-1, 1)})), batch)
           for share in ("auto", "none")}
  one = LanguageModelTrainer(lora_config(base, rates=()))
  abstract = one.states.abstract(batch)
  base_bytes = sum(x.size * x.dtype.itemsize for p, x in _leaves(abstract.params).items()
                   if "_lora_" not in p)
  adapter_bytes = sum(x.size * x.dtype.itemsize for p, x in _leaves(abstract.params).items()
                      if "_lora_" in p)
  # 8 members on 8 devices: one member's adapters per device, and one base, either way;
  # stacked, the base is a member's too: the same bytes. The difference shows at 2 a device.
  assert plans["auto"].params_bytes == base_bytes + adapter_bytes
  assert plans["none"].params_bytes == base_bytes + adapter_bytes
  packed = {share: make_plan(LanguageModelTrainer(lora_config(
      base, rates=rates, **{"strategy.share_frozen": share,
                            "strategy.ensemble_mesh_shape": (1, -1)})), batch)
            for share in ("auto", "none")}
  assert packed["auto"].params_bytes == base_bytes + members * adapter_bytes
  assert packed["none"].params_bytes == members * (base_bytes + adapter_bytes)


def test_a_checkpoint_holds_the_base_once_resumes_and_gives_one_member(base, tmp_path):
  config = lora_config(base)
  trainer = LanguageModelTrainer(config)
  straight = trainer.fit(stream, num_steps=4).state
  checkpointer = Checkpointer(str(tmp_path / "ckpt"), every_steps=2, async_save=False)
  LanguageModelTrainer(config).fit(stream, num_steps=2, checkpointer=checkpointer)
  saved = _leaves(checkpointer.saved_arrays(2)["params"])
  kernel = next(p for p in saved if p.endswith("['down_proj']['kernel']['value']"))
  assert len(saved[kernel].shape) == 3  # [layer, mlp, embed]: no member axis.
  resumed = LanguageModelTrainer(config).fit(stream, num_steps=4, checkpointer=checkpointer)
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed.state.params),
               jax.device_get(straight.params))
  members = jax.device_get(trainer.strategy.to_canonical(straight).params)
  single = LanguageModelTrainer(lora_config(base, rates=(), learning_rate=RATES[1]))
  one = single.restore_checkpoint(checkpointer, next(stream(0)), member=1)
  jax.tree.map(lambda m, s: np.testing.assert_array_equal(m[1], s), members,
               jax.device_get(one.params))
  stacked = LanguageModelTrainer(lora_config(base, **{"strategy.share_frozen": "none"}))
  with pytest.raises(CheckpointError, match=r"holds its frozen parts once .* "
                                            r"config\.strategy\.share_frozen"):
    stacked.fit(stream, num_steps=6, checkpointer=checkpointer)
  # Member 1 out of the shared checkpoint: merged for transformers, and as a PEFT adapter.
  tokens = next(stream(0))["inputs"][:4]
  ours = _logits(single, one, tokens)
  merged = tmp_path / "merged"
  export_checkpoint(str(tmp_path / "ckpt"), str(merged), member=1, config=config.to_dict())
  np.testing.assert_allclose(_hf_logits(transformers.AutoModelForCausalLM.from_pretrained(
      str(merged)), tokens), ours, atol=1e-4)
  adapter = tmp_path / "adapter"
  export_checkpoint(str(tmp_path / "ckpt"), str(adapter), member=1, config=config.to_dict(),
                    adapters=True)
  theirs = _peft_logits(base, adapter, tokens)
  np.testing.assert_allclose(theirs, ours, atol=1e-4)
  assert np.abs(theirs - _hf_logits(_hf_base(base), tokens)).max() > 1e-3  # Trained.
  # The adapter as a new run's starting point, over the same base: member 1's weights.
  again = LanguageModelTrainer(lora_config(base, rates=(), **{
      "init_from.adapters": str(adapter)}))
  start = jax.device_get(again.init_state(next(stream(0))).params)
  jax.tree.map(lambda m, s: np.testing.assert_allclose(m[1], s, rtol=1e-6, atol=1e-7),
               members, start)
  with pytest.raises(ValueError, match=r"config\.init_from\.adapters=.* holds adapters of "
                                       r"r=2, lora_alpha=4\.0; set config\.lora\.rank=2"):
    LanguageModelTrainer(lora_config(base, rates=(), **{
        "init_from.adapters": str(adapter), "lora.rank": 4}))


def _logits(trainer, state, tokens):
  logits = jax.jit(lambda p, s: trainer.model_variables.apply(
      p, s, ((tokens,), {}), rngs={"dropout": jax.random.PRNGKey(0)}, train=False)[0])(
          state.params, state.model_state)
  return np.asarray(logits)[..., :pf.VOCAB]


def _hf_base(directory):
  import transformers
  return transformers.AutoModelForCausalLM.from_pretrained(str(directory)).eval()


def _hf_logits(model, tokens):
  with torch.no_grad():
    return model.eval()(torch.tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()


def _peft_logits(base, adapter, tokens):
  peft = pytest.importorskip("peft")
  with open(adapter / "adapter_config.json") as f:
    assert json.load(f)["base_model_name_or_path"] == str(base)
  return _hf_logits(peft.PeftModel.from_pretrained(_hf_base(base), str(adapter)), tokens)


def test_gpt2_adapters_go_out_in_pefts_conv1d_layout(tmp_path):
  """GPT-2's HF weights are `Conv1D`s, `[in, out]`: PEFT's `fan_in_fan_out`."""
  gpt2 = tmp_path / "gpt2"
  pf.save_model("gpt2", gpt2, seed=4, jitter=0.2)
  config = lora_config(gpt2, rates=(), learning_rate=0.3)
  config.lora.targets = (".*attn/c_attn/kernel", ".*mlp/c_proj/kernel")
  trainer = LanguageModelTrainer(config)
  checkpointer = Checkpointer(str(tmp_path / "ckpt"), every_steps=2, async_save=False)
  state = trainer.fit(stream, num_steps=2, checkpointer=checkpointer).state
  export_checkpoint(str(tmp_path / "ckpt"), str(tmp_path / "adapter"),
                    config=config.to_dict(), adapters=True)
  with open(tmp_path / "adapter" / "adapter_config.json") as f:
    written = json.load(f)
  assert written["fan_in_fan_out"] and sorted(written["target_modules"]) == [
      f"transformer.h.{i}.{m}" for i in range(2) for m in ("attn.c_attn", "mlp.c_proj")]
  tokens = next(stream(0))["inputs"][:4]
  np.testing.assert_allclose(_peft_logits(gpt2, tmp_path / "adapter", tokens),
                             _logits(trainer, jax.device_get(state), tokens), atol=1e-4)
  config.init_from.adapters = str(tmp_path / "adapter")  # Back in, as a starting point.
  start = LanguageModelTrainer(config).init_state(next(stream(0)))
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(start.params),
               jax.device_get(state.params))


@pytest.mark.parametrize("overrides,match", [
    ({"strategy.share_frozen": "weights"},
     r"config\.strategy\.share_frozen='weights' names \['weights'\]; it must be 'auto', "
     r"'none' or a comma-separated list of \('base', 'reference', 'teacher'\)"),
    ({"strategy.share_frozen": "teacher"},
     r"names 'teacher', which cannot be held once: the state holds no teacher"),
    ({"strategy.share_frozen": "base", "init_from.path": "", "sweep.seeds": (1, 2),
      "sweep.grid.learning_rate": (0.1,)},
     r"names 'base', which cannot be held once: what config\.init_from does not load starts "
     r"from each member's own seed"),
    ({"strategy.share_frozen": "base", "strategy.name": "pmap_ensemble", "ensemble_size": 8,
      "sweep.grid.learning_rate": ()},
     r"share_frozen='base' with config\.strategy\.name='pmap_ensemble': a pmap ensemble "
     r"holds one member per device"),
    ({"strategy.share_frozen": "base", "lora.rank": 0, "lora.targets": ()},
     r"names 'base', which cannot be held once: no parameter is frozen"),
])
def test_what_cannot_be_shared_is_refused_before_compute(base, overrides, match):
  config = lora_config(base)
  config.update_from_flattened_dict(overrides)
  with pytest.raises(ValueError, match=match):
    trainer = LanguageModelTrainer(config)
    trainer.states.abstract(next(stream(0)))  # Shapes only: nothing is computed.


def test_a_sweep_over_the_rank_is_refused_naming_the_field(base):
  config = lora_config(base)
  with pytest.raises(ValueError, match=r"config\.sweep\.grid has \['rank'\], which cannot be "
                                       r"swept; .*LoRA's rank: adapters of another shape"):
    config.sweep.grid.rank = (2, 4)
    LanguageModelTrainer(config)


def _resume_run(base, workdir, out, *extra):
  return subprocess.run([sys.executable, str(pathlib.Path(__file__).parent /
                                             "shared_resume_run.py"),
                         f"--base={base}", f"--workdir={workdir}", f"--out={out}", *extra],
                        capture_output=True, text=True, timeout=600)


def test_a_sweep_killed_at_and_past_a_checkpoint_resumes_bitwise_equal(base, tmp_path):
  """SIGKILLed right after the checkpoint of step 4, then 3 steps past it (checkpoints every
  4), rerun each time: the final state (the base held once, the adapters per member) is
  the uninterrupted run's, bit for bit."""
  final = killed_and_resumed(lambda *a: _resume_run(base, *a), tmp_path)
  kernels = [k for k in final if k.startswith(".params") and "['down_proj']['kernel']" in k]
  assert kernels and all(final[k].ndim == 3 for k in kernels)  # [layer, mlp, embed]: once.


# -- Each member its own data (many tenants) ----------------------------------------------


def _corpora(root, count=4):
  """`count` corpora of different words (`pf.WORDS[i::count]`), each a train and a
  held-out JSONL file of `text` records."""
  rng = np.random.default_rng(7)
  train, held = [], []
  for i in range(count):
    words = pf.WORDS[i::count]
    texts = [" ".join(rng.choice(words, int(rng.integers(4, 20)))) for _ in range(60)]
    train.append(str(pf.write_jsonl(root / f"train{i}.jsonl",
                                    [{"text": t} for t in texts[:48]])))
    held.append(str(pf.write_jsonl(root / f"held{i}.jsonl", [{"text": t} for t in texts[48:]])))
  return train, held


def _tenant(config, sources, held):
  config.data.update(sources=tuple(sources), eval_sources=tuple(held), workers=0, lanes=1,
                     shuffle_files=False)
  return config


def test_four_adapters_train_on_four_corpora_in_one_program_each_as_its_own_run(base,
                                                                               tmp_path):
  """A sweep of 4 adapters over one base, member i reading corpus i (its own train and
  held-out files) in one step for all: each member's adapters and held-out loss are its
  own run's; the batch holds each member's rows, placed with the member."""
  from trainer.data import lm
  train, held = _corpora(tmp_path)
  rates = (0.05, 0.1, 0.2, 0.3)
  config = _tenant(lora_config(base, rates=rates, **{"strategy.ensemble_mesh_shape": (2, -1),
                                                     "eval_batch_size": 8}), (), ())
  config.data.update(member_sources=tuple((t,) for t in train),
                     member_eval_sources=tuple((h,) for h in held))
  trainer = LanguageModelTrainer(config)
  assert trainer.strategy.batch_models == 4
  first = next(lm.from_config(config)())
  assert first["inputs"].shape[:2] == (4, config.batch_size)
  swept = trainer.fit(lm.from_config(config), num_steps=3).state
  each = trainer.evaluator.evaluate_members(swept, lm.eval_batches(config))
  members = jax.device_get(trainer.strategy.to_canonical(swept).params)
  losses = []
  for i, rate in enumerate(rates):
    single_config = _tenant(lora_config(base, rates=(), learning_rate=rate, eval_batch_size=8),
                            (train[i],), (held[i],))
    single = LanguageModelTrainer(single_config)
    state = single.fit(lm.from_config(single_config), num_steps=3).state
    jax.tree.map(lambda m, s, i=i: np.testing.assert_allclose(m[i], s, rtol=1e-5, atol=1e-6),
                 members, jax.device_get(state.params))
    own = single.evaluate(state, lm.eval_batches(single_config))["loss"]
    np.testing.assert_allclose(each[i]["loss"], own, rtol=1e-5)
    losses.append(own)
  assert len(set(np.round(losses, 4))) == 4  # Four corpora: four different held-out losses.


def test_member_sources_are_refused_where_they_cannot_go(base, tmp_path):
  train, held = _corpora(tmp_path, count=2)
  config = _tenant(lora_config(base, rates=(0.1, 0.2, 0.3, 0.4)), (), ())
  config.data.member_sources = tuple((t,) for t in train)
  with pytest.raises(ValueError, match=r"config\.data\.member_sources has 2 entries for the 4 "
                                       r"members"):
    LanguageModelTrainer(config)
  config = _tenant(lora_config(base, rates=()), (), ())
  config.data.member_sources = tuple((t,) for t in train)
  with pytest.raises(ValueError, match=r"config\.data\.member_sources gives each member its "
                                       r"own data, .*strategy\.name='sharded_data_parallel'"):
    LanguageModelTrainer(config)


def test_each_members_data_position_is_saved_and_resumed(base, tmp_path):
  """Checkpointed at step 2 and resumed to 4, two steps a call: every member's corpus
  continues where it stopped (the final state is the straight run's, bit for bit)."""
  from trainer.data import lm
  train, held = _corpora(tmp_path, count=2)
  config = _tenant(lora_config(base, steps_per_call=2), (), ())
  config.data.member_sources = tuple((t,) for t in train)
  straight = LanguageModelTrainer(config).fit(lm.from_config(config), num_steps=4).state
  checkpointer = Checkpointer(str(tmp_path / "ckpt"), every_steps=2, async_save=False)
  LanguageModelTrainer(config).fit(lm.from_config(config), num_steps=2,
                                   checkpointer=checkpointer)
  assert "members" in checkpointer.layout(2)["data"]
  resumed = LanguageModelTrainer(config).fit(lm.from_config(config), num_steps=4,
                                             checkpointer=checkpointer).state
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed.params),
               jax.device_get(straight.params))
