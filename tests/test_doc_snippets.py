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
