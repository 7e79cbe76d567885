"""Generation with a key/value cache (`trainer.generation`, `models.kv_cache`).

Cached logits equal a full recompute at every step for each family (Linen and NNX,
dense and mixture of experts, a sliding window, Llama 3.1's rope), within the float32
noise of the computation (`tests/numerics.py`'s chaos runs); greedy tokens equal
`transformers`' `generate(do_sample=False)` for tiny random GPT-2, Llama 3, Qwen3,
Mistral (prompts past its window) and Mixtral checkpoints, under one device and data x
tensor parallelism (Llama 3 also FSDP); sampling follows its rules and a seed gives the
same tokens under every layout; the dry run counts the cache per device; bad requests
are refused before compute, naming the field.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_fixtures import VOCAB, lm_batch, run_config, save_random
from numerics import perturbed, tolerances
from small_configs import tiny_lm_config

from models.gpt2 import GPT2LM
from models.llama import LlamaLM
from models.transformer import TransformerLM
from trainer.generation import Generator, Sampling, choose
from trainer.language_model import LanguageModelTrainer
from trainer.step import model_variables

#: Prompts of different lengths (the longest past Mistral's window of 4), new tokens.
PROMPTS = [[5, 17, 3, 60, 22, 9], [41, 7, 7, 30, 12, 55, 2, 19, 33, 48, 11], [26, 8, 50]]
NEW = 8
STOP = 3

RNG = np.random.default_rng(0)
ROWS, PROMPT, STEPS, V = 3, 7, 4, 40
LENGTHS = np.array([7, 3, 5], np.int32)
SEQUENCES = RNG.integers(0, V, (ROWS, PROMPT + STEPS)).astype(np.int32)


def _families():
  llama = dict(vocab_size=V, max_len=16, num_layers=2, embed_dim=32, num_heads=4,
               num_kv_heads=2, mlp_dim=48)
  return {
      "transformer": TransformerLM(vocab_size=V, max_len=16, embed_dim=32, mlp_dim=48),
      "transformer_moe": TransformerLM(vocab_size=V, max_len=16, embed_dim=32, mlp_dim=24,
                                       num_experts=4),
      "gpt2": GPT2LM(vocab_size=V, max_len=16, embed_dim=32, mlp_dim=48),
      "llama_window_rope": functools.partial(
          LlamaLM, **llama, sliding_window=3, qk_norm=True, rope_scaling=dict(
              factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=8)),
      "llama_moe": functools.partial(LlamaLM, **llama, num_experts=4, moe_mlp_dim=24),
  }


def _logits(outputs):
  return np.asarray(getattr(outputs, "logits", outputs))


def cached_and_recomputed(module, sequences, lengths, prompt: int, steps: int):
  """`(cached, recomputed, limit)`: each row's logits at its own positions from a cache
  (right-padded prompts of `lengths` prefilled in `prompt` slots, then `steps` decode steps)
  and from the whole sequence recomputed, and the chaos runs' drift (the same recompute from
  parameters moved by +-1e-6), `[rows, steps + 1, vocab]` each."""
  from models import kv_cache
  mv = model_variables.create(module)
  rngs = {"params": jax.random.PRNGKey(0), "dropout": jax.random.PRNGKey(1)}
  params, model_state = mv.init(rngs, ((sequences,), {}))
  rows = np.arange(len(sequences))

  def recompute(params):
    return _logits(mv.apply(params, model_state, ((sequences,), {}), rngs=rngs,
                            train=False)[0])

  @jax.jit
  def decode(params, cache, tokens, positions):
    outputs, cache = mv.decode(params, model_state, cache, ((tokens,), {"positions": positions}),
                               rngs=rngs, length=prompt + steps)
    return getattr(outputs, "logits", outputs), cache

  prompts = np.where(np.arange(prompt)[None] < lengths[:, None], sequences[:, :prompt], 0)
  positions = np.broadcast_to(np.arange(prompt, dtype=np.int32), (len(rows), prompt))
  logits, cache = decode(params, None, prompts, positions)
  got = [np.asarray(logits)[rows, lengths - 1]]
  cache = kv_cache.set_index(cache, jnp.asarray(lengths))
  for t in range(steps):
    where = lengths + t
    logits, cache = decode(params, cache, sequences[rows, where][:, None], where[:, None])
    got.append(np.asarray(logits)[:, 0])
  at = lengths[:, None] - 1 + np.arange(steps + 1)[None]  # Each row's compared positions.
  reference = recompute(params)[rows[:, None], at]
  chaos = [recompute(perturbed(params, s))[rows[:, None], at] for s in (1e-6, -1e-6)]
  (limit,) = tolerances(reference, [[c] for c in chaos])
  return np.stack(got, axis=1), reference, limit


@pytest.mark.parametrize("family", list(_families()))
def test_cached_logits_equal_a_full_recompute_at_every_step(family):
  """Right-padded prompts of lengths 7, 3, 5 prefilled, then 4 decode steps: each row's
  logits at its own position equal the whole sequence recomputed, within the chaos runs'
  drift (the same recompute from parameters moved by +-1e-6)."""
  got, reference, limit = cached_and_recomputed(_families()[family], SEQUENCES, LENGTHS,
                                                PROMPT, STEPS)
  np.testing.assert_allclose(got, reference, rtol=0, atol=limit,
                             err_msg=f"{family}: cached logits against the recompute")
  assert np.abs(reference[:, 1:] - reference[:, :1]).max() > 100 * limit  # Steps differ.


def _hf_config(kind):
  import transformers
  widths = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                tie_word_embeddings=False)
  if kind == "gpt2":
    return transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2,
                                   n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
  if kind == "llama3":
    return transformers.LlamaConfig(**widths, rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
        high_freq_factor=4.0, original_max_position_embeddings=8))
  if kind == "qwen3":
    return transformers.Qwen3Config(**widths, head_dim=8)
  if kind == "mistral":  # A window of 4: every prompt but the last is past it.
    return transformers.MistralConfig(**widths, sliding_window=4)
  return transformers.MixtralConfig(**{**widths, "intermediate_size": 24}, num_local_experts=4)


HF_KINDS = ("gpt2", "llama3", "qwen3", "mistral", "mixtral")


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
  """`{kind: (directory, transformers' greedy continuations of PROMPTS)}`."""
  torch = pytest.importorskip("torch")
  pytest.importorskip("transformers")
  torch.manual_seed(0)
  out = {}
  for kind in HF_KINDS:
    directory = str(tmp_path_factory.mktemp(kind))
    model = save_random(_hf_config(kind), directory, jitter=0.05)
    continuations = []
    for prompt in PROMPTS:
      ids = torch.tensor([prompt], dtype=torch.long)
      with torch.no_grad():
        done = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=NEW, eos_token_id=STOP, pad_token_id=0)
      continuations.append(done[0, len(prompt):].tolist())
    out[kind] = (directory, continuations)
  return out


def _trainer_and_state(path, layout):
  config = run_config(path, "data_tensor" if layout == "single_device" else layout)
  if layout == "single_device":
    config.strategy.name = "single_device"
  trainer = LanguageModelTrainer(config)
  tokens = np.zeros((config.batch_size, config.seq_len), np.int32)
  return trainer, trainer.init_state(lm_batch(tokens))


@pytest.mark.parametrize("kind", HF_KINDS)
def test_greedy_tokens_equal_transformers_generate(hf_models, kind):
  """The same checkpoint, prompts of 6, 11 and 3 tokens batched together, greedy, stop id
  3: token for token what `transformers` generates for each prompt alone, under one device
  and under data x tensor (the cache laid out by the rules)."""
  path, expected = hf_models[kind]
  sampling = Sampling(max_new_tokens=NEW, stop_tokens=(STOP,))
  sampled = {}
  layouts = ("single_device", "data_tensor") + (("fsdp",) if kind == "llama3" else ())
  for layout in layouts:
    trainer, state = _trainer_and_state(path, layout)
    out = Generator.from_trainer(trainer)(state, PROMPTS, sampling)
    assert out.tokens == expected, f"{kind} under {layout}"
    assert out.stopped == [STOP in row for row in expected]
    if kind == "llama3":  # A seed draws the same tokens under every layout.
      drawn = Generator.from_trainer(trainer)(
          state, PROMPTS, Sampling(max_new_tokens=NEW, temperature=1.5, top_k=20, top_p=0.95),
          seed=7)
      sampled[layout] = drawn.tokens
  if sampled:
    assert sampled["single_device"] == sampled["data_tensor"] == sampled["fsdp"] != expected


def test_choose_follows_temperature_top_k_and_top_p():
  logits = jnp.log(jnp.asarray([[0.1, 0.4, 0.2, 0.3]] * 256))
  keys = jax.random.key_data(jax.random.split(jax.random.key(0), 256))
  greedy = choose(logits, keys, 0, Sampling())
  assert set(np.asarray(greedy)) == {1}
  assert set(np.asarray(choose(logits, keys, 0, Sampling(temperature=1.0, top_k=1)))) == {1}
  # Nucleus 0.5: 0.4 alone falls short, 0.4 + 0.3 reaches it; 0.2 and 0.1 never drawn.
  assert set(np.asarray(choose(logits, keys, 0, Sampling(temperature=1.0, top_p=0.5)))) == {
      1, 3}
  # Top 3 at temperature 1: each kept token about as often as its renormalised share.
  drawn = np.asarray(choose(logits, keys, 5, Sampling(temperature=1.0, top_k=3)))
  counts = np.bincount(drawn, minlength=4) / drawn.size
  assert counts[0] == 0 and np.allclose(counts[1:], [4 / 9, 2 / 9, 3 / 9], atol=0.1)
  # A step is folded into each row's key: another step, other draws.
  again = np.asarray(choose(logits, keys, 6, Sampling(temperature=1.0, top_k=3)))
  assert (again != drawn).any()


@pytest.fixture(scope="module")
def tiny():
  trainer = LanguageModelTrainer(tiny_lm_config("data_parallel"))
  tokens = np.zeros((16, 16), np.int32)
  return trainer, trainer.init_state(lm_batch(tokens))


def test_stop_tokens_end_each_row_at_its_own_step(tiny):
  trainer, state = tiny
  generator = Generator.from_trainer(trainer)
  prompts = [[1, 2, 3], [4], [5, 6, 7, 8, 9]]
  free = generator(state, prompts, Sampling(max_new_tokens=6)).tokens
  stop = free[0][2]
  out = generator(state, prompts, Sampling(max_new_tokens=6, stop_tokens=(stop,)))
  for row, got, stopped in zip(free, out.tokens, out.stopped, strict=True):
    cut = row.index(stop) + 1 if stop in row else len(row)
    assert got == row[:cut] and stopped == (stop in row)
  assert len(out.tokens[0]) == 3


@pytest.mark.parametrize("field, value, message", [
    ("temperature", -0.5, "sampling.temperature=-0.5"),
    ("top_p", 0.0, "sampling.top_p=0.0"),
    ("top_p", 1.5, "sampling.top_p=1.5"),
    ("top_k", -1, "sampling.top_k=-1"),
    ("max_new_tokens", 0, "sampling.max_new_tokens=0"),
])
def test_bad_sampling_is_refused(tiny, field, value, message):
  trainer, state = tiny
  with pytest.raises(ValueError, match=message.replace(".", r"\.")):
    Generator.from_trainer(trainer)(state, [[1, 2]], Sampling(**{field: value}))


def test_prompts_that_do_not_fit_are_refused_before_compute(tiny):
  trainer, state = tiny
  generator = Generator.from_trainer(trainer)  # max_len 16
  with pytest.raises(ValueError, match=r"prompt 1 holds 17 tokens.*max_len=16"):
    generator(state, [[1], [2] * 17], Sampling(max_new_tokens=1))
  with pytest.raises(ValueError, match=r"max_new_tokens=8.*12 tokens.*at most 4 new"):
    generator(state, [[1] * 12], Sampling(max_new_tokens=8))
  with pytest.raises(ValueError, match=r"prompt 0 is empty"):
    generator(state, [[]], Sampling(max_new_tokens=1))
  with pytest.raises(ValueError, match=r"\[0, 32\).*got 40"):
    generator(state, [[40]], Sampling(max_new_tokens=1))
  with pytest.raises(ValueError, match=r"\[0, 32\).*got -1 \(prompt 1, position 1\)"):
    generator(state, [[3], [5, -1, 7]], Sampling(max_new_tokens=1))  # The bad id, named.
  assert not generator._programs  # Nothing was compiled.


@pytest.mark.parametrize("layout, names", [
    ("pipeline", "'stage'"), ("context", "'context'")])
def test_layouts_that_split_the_cache_are_refused(layout, names):
  trainer = LanguageModelTrainer(tiny_lm_config(layout))
  with pytest.raises(ValueError, match=names):
    Generator.from_trainer(trainer).check_layout()


def test_ensembles_and_per_device_strategies_are_refused():
  for name, expected in (("pmap_ensemble", "one member's state"),
                         ("pmap_data_parallel", "per device")):
    config = tiny_lm_config("data_parallel")
    config.strategy.name = name
    with pytest.raises(ValueError, match=expected):
      Generator.from_trainer(LanguageModelTrainer(config)).check_layout()


def test_nnx_model_without_init_cache_is_refused():
  class Plain(nnx.Module):
    def __init__(self, rngs):
      self.embed = nnx.Embed(8, 4, rngs=rngs)

    def __call__(self, tokens, positions=None):
      return self.embed(tokens)

  mv = model_variables.create(Plain)
  rngs = {"params": jax.random.PRNGKey(0)}
  params, state = mv.init(rngs, ((np.zeros((1, 2), np.int32),), {}))
  with pytest.raises(TypeError, match="no init_cache"):
    mv.decode(params, state, None, ((np.zeros((1, 2), np.int32),), {}), rngs=rngs, length=4)


def test_the_command_generates_from_a_hugging_face_directory(hf_models):
  """`python -m trainer.generate --init_from=DIR --token_ids`'s path: the directory's model on
  one device, its greedy tokens transformers' own."""
  from trainer import generate as command
  path, expected = hf_models["gpt2"]
  config = command.run_config(None, path, None)
  prompts, new = command.generate(config, [",".join(map(str, PROMPTS[1]))], token_ids=True,
                                  sampling=Sampling(max_new_tokens=NEW), stop_ids=str(STOP))
  assert prompts == [PROMPTS[1]] and new == [expected[1]]


def test_the_command_refuses_what_it_cannot_serve(tmp_path):
  from trainer import generate as command
  with pytest.raises(ValueError, match="exactly one of --workdir"):
    command.run_config(None, None, None)
  with pytest.raises(ValueError, match="not a Hugging Face model directory"):
    command.run_config(None, str(tmp_path), None)
  with pytest.raises(ValueError, match="config.json.*does not exist"):
    command.run_config(str(tmp_path), None, None)
  with pytest.raises(ValueError, match="no prompts"):
    command.read_prompts([], None)
  config = tiny_lm_config("data_parallel")
  with pytest.raises(ValueError, match="comma-separated integers"):
    command.generate(config, ["1,x"], token_ids=True)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_dry_run_counts_the_cache_per_device(family):
  """`trainer.plan --generate=ROWSxPOSITIONS`: the cache's bytes from its logical names
  through the rule table (data x tensor, 2 x 4): GPT-2's heads split over `model`, a
  Llama's 2 key/value heads kept whole (`configs/lm.py`), rows over `data` for both."""
  from trainer.generation import cache_bytes
  from trainer.plan import make_plan
  config = tiny_lm_config("data_tensor", **{"model.family": family})
  if family == "llama":
    config.model.num_kv_heads = 2
  trainer = LanguageModelTrainer(config)
  rows, slots, layers, heads = 8, 16, 2, (8 if family == "gpt2" else 2)
  batch = lm_batch(np.zeros((16, 16), np.int32))
  kv = 2 * layers * rows * slots * heads * 4 * 4  # key and value, head_dim 4, float32.
  index = layers * rows * 4
  split = 8 if family == "gpt2" else 2
  want = (kv + index, kv // split + index // 2)
  abstract = trainer.strategy.checkpoint_target(trainer.states.abstract(batch))
  assert cache_bytes(trainer, abstract, rows, slots) == want
  if family == "gpt2":
    plan = make_plan(trainer, batch, generate=(rows, slots))
    assert plan.generation == (rows, slots, *want)
    assert "generation cache" in plan.report()


def test_a_runs_workdir_generates_after_its_training_files_are_gone(tmp_path):
  """A corpus run's config names its train and held-out files (and its tokenizer); the
  command reads neither data file, and a tokenizer that is gone is named with --tokenizer
  as the way on."""
  import json

  from trainer import generate as command
  config = tiny_lm_config("data_parallel")
  config.data.update(sources=(str(tmp_path / "gone" / "train-*.jsonl"),),
                     eval_sources=(str(tmp_path / "gone" / "valid.jsonl"),),
                     tokenizer=str(tmp_path / "gone"))
  (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
  restored = command.run_config(str(tmp_path), None, None)
  assert not restored.data.sources and not restored.data.eval_sources
  from trainer.data import lm
  assert lm.check_config(restored) == []  # No data file is looked for.
  with pytest.raises(ValueError, match=r"gone.*Pass --tokenizer="):
    command.generate(restored, ["hello"])


def test_cached_logits_equal_a_full_recompute_at_a_users_lengths():
  """The same at prompts of 1,024 and 515 tokens (a Llama with rotary positions past 1,024):
  toy lengths hide an index or a cache slot that only long rows reach."""
  module = functools.partial(LlamaLM, vocab_size=64, max_len=1040, num_layers=2,
                             embed_dim=32, num_heads=4, num_kv_heads=2, mlp_dim=48)
  sequences = np.random.default_rng(1).integers(0, 64, (2, 1024 + 3)).astype(np.int32)
  got, reference, limit = cached_and_recomputed(module, sequences,
                                                np.array([1024, 515], np.int32), 1024, 3)
  np.testing.assert_allclose(got, reference, rtol=0, atol=limit)
  assert np.abs(reference[:, 1:] - reference[:, :1]).max() > 100 * limit
