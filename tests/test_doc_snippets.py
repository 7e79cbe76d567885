"""The guides' Python blocks that a user copies, run as written (a path replaced by one the
test makes), with what each promises checked."""

import contextlib
import io
import json
import pathlib
import re

import jax
import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def python_block(page: str, after: str) -> str:
  """The first ```python block of `docs/<page>` after the line that starts with `after`."""
  text = (ROOT / "docs" / page).read_text()
  start = text.index("\n" + after)
  return re.search(r"```python\n(.*?)```", text[start:], flags=re.S).group(1)


def test_a_direct_caller_picks_blockwise_attention_with_using():
  from models import attention
  code = python_block("guides/long_context.md", "A model the Trainer builds gets the method")
  namespace = {}
  exec(code, namespace)  # noqa: S102
  np.testing.assert_allclose(namespace["out"], namespace["plain"], atol=1e-5, rtol=0)
  q = namespace["q"]
  length = q.shape[1]

  def sizes(jaxpr):  # Every value a jaxpr makes, nested jaxprs (jit, scan, remat) included.
    for eqn in jaxpr.eqns:
      yield from (int(np.prod(v.aval.shape)) for v in eqn.outvars)
      for value in eqn.params.values():
        for sub in value if isinstance(value, (list, tuple)) else (value,):
          inner = getattr(sub, "jaxpr", sub)
          if hasattr(inner, "eqns"):
            yield from sizes(inner)

  def largest_intermediate(method):
    with attention.using(method):  # A function of its own: jit's cache holds none of it.
      jaxpr = jax.make_jaxpr(lambda q: attention.attention(q, q, q))(q)
    return max(sizes(jaxpr.jaxpr))

  # Inside `using`, no [length, length] score matrix per head is made; outside, it is.
  blockwise = attention.Method("blockwise", block_size=256)
  assert largest_intermediate(blockwise) < length * length
  assert largest_intermediate(None) >= q.shape[2] * length * length


def test_the_generation_guides_hugging_face_state_generates_as_transformers(tmp_path):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  from hf_fixtures import ATOL, save_random
  from tokenizers import Tokenizer, models, pre_tokenizers

  torch.manual_seed(0)
  config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                    num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, max_position_embeddings=32)
  model = save_random(config, str(tmp_path), jitter=0.05)
  words = ["The", "tests", "make", "every", "command", "run"]
  vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(words)}}
  tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
  tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tokenizer.save(str(tmp_path / "tokenizer.json"))
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(
      {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}))

  code = python_block("guides/generation.md", "### A state for a Hugging Face model")
  assert '"/path/to/hf_model"' in code
  namespace, printed = {}, io.StringIO()
  with contextlib.redirect_stdout(printed):
    exec(code.replace('"/path/to/hf_model"', repr(str(tmp_path))), namespace)  # noqa: S102
  prompt = [1, 3, 4, 5]  # <s> The tests make
  ids = torch.tensor([prompt], dtype=torch.long)
  with torch.no_grad():
    done = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=8, eos_token_id=2, pad_token_id=0)
  expected = done[0, len(prompt):].tolist()
  assert namespace["out"].tokens[0] == expected
  assert printed.getvalue().strip() == tokenizer.decode(expected, skip_special_tokens=True)
  # The next block: the logits of a prompt, equal to transformers' for the checkpoint.
  exec(python_block("guides/generation.md", "### The model's logits for a prompt"),  # noqa: S102
       namespace)
  assert namespace["ids"] == prompt
  with torch.no_grad():
    theirs = model(ids).logits[0].numpy()
  np.testing.assert_allclose(namespace["logits"], theirs, atol=ATOL, rtol=0)
  assert namespace["next_token"] == expected[0]


def test_the_pretrained_guides_peft_block_loads_an_exported_adapter(tmp_path):
  """The block that loads `--adapters`' output with PEFT, on a tiny Llama and a LoRA run
  over it (its paths replaced by the test's): the adapted model's logits are ours."""
  pytest.importorskip("peft")
  import preference_files as pf
  from shared_setup import lora_config, stream

  from trainer.checkpoint import Checkpointer
  from trainer.export import export_checkpoint
  from trainer.language_model import LanguageModelTrainer
  base = tmp_path / "base"
  pf.save_model("llama", base, seed=5, jitter=0.2)
  config = lora_config(base, rates=(), learning_rate=0.3)
  trainer = LanguageModelTrainer(config)
  checkpointer = Checkpointer(str(tmp_path / "ckpt"), every_steps=2, async_save=False)
  state = trainer.fit(stream, num_steps=2, checkpointer=checkpointer).state
  export_checkpoint(str(tmp_path / "ckpt"), str(tmp_path / "peft"), config=config.to_dict(),
                    adapters=True)
  code = python_block("guides/pretrained.md", "writes the run's adapters alone")
  namespace = {}
  exec(code.replace('"/tmp/finetune/hf"', repr(str(base))).replace(  # noqa: S102
      '"/tmp/finetune_lora_peft"', repr(str(tmp_path / "peft"))), namespace)
  import torch
  tokens = next(stream(0))["inputs"][:2]
  with torch.no_grad():
    theirs = namespace["model"](torch.tensor(tokens, dtype=torch.long)).logits.numpy()
  ours = jax.jit(lambda p, s: trainer.model_variables.apply(
      p, s, ((tokens,), {}), rngs={"dropout": jax.random.PRNGKey(0)}, train=False)[0])(
          state.params, state.model_state)
  np.testing.assert_allclose(np.asarray(ours)[..., :pf.VOCAB], theirs, atol=1e-4)
