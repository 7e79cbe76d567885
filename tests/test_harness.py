"""lm-evaluation-harness over a trained state (`trainer.harness`), offline.

A tiny random GPT-2 made with `transformers` and a word-level tokenizer written here;
two tasks in the harness's YAML format on JSONL files the test writes (a multiple-choice
task and a perplexity task). The log-likelihoods our model interface gives equal
`transformers`' for the same checkpoint and records (atol 1e-4), under data x tensor
parallelism; the harness's `acc`/`acc_norm` are what those log-likelihoods give; its
rolling log-likelihood spans documents longer than the model's positions; the action
writes the metrics and generations to the writers during training; unknown tasks are
refused naming where the harness looked.
"""

import json
import os

import numpy as np
import pytest
from hf_fixtures import ATOL, VOCAB, lm_batch, run_config, save_random
from recorder import Recorder

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402

from trainer import harness  # noqa: E402
from trainer.language_model import LanguageModelTrainer  # noqa: E402

WORDS = [f"w{i}" for i in range(VOCAB - 2)]
CHOICE_DOCS = [
    {"question": "w1 w2 w3", "choices": ["w4", "w5 w6", "w7 w8 w9"], "answer": 1},
    {"question": "w10 w11", "choices": ["w12 w13", "w14"], "answer": 0},
    {"question": "w20 w21 w22 w23", "choices": ["w24", "w25", "w26 w27"], "answer": 2},
    {"question": "w30", "choices": ["w31 w32 w33 w34", "w35"], "answer": 1},
]
#: The second document is longer than the model's 32 positions: several rolling windows.
PPL_DOCS = [{"text": " ".join(WORDS[3:13])},
            {"text": " ".join(WORDS[i % 50] for i in range(70))}]

CHOICE_YAML = """task: tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""
PPL_YAML = """task: tiny_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""


def _write_tokenizer(directory):
  from tokenizers import Tokenizer, models, pre_tokenizers
  vocab = {"<eos>": 0, "<unk>": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
  tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
  tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  from tokenizers import decoders
  tokenizer.decoder = decoders.WordPiece(prefix="##")  # Joins words with spaces.
  tokenizer.save(os.path.join(directory, "tokenizer.json"))
  with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
    json.dump({"eos_token": "<eos>"}, f)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  """`(model dir, HF model, task dir, trainer, state)`: GPT-2 under data x tensor."""
  torch.manual_seed(0)
  directory = str(tmp_path_factory.mktemp("gpt2"))
  model = save_random(transformers.GPT2Config(
      vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
      embd_pdrop=0.0, attn_pdrop=0.0), directory, jitter=0.05)
  _write_tokenizer(directory)
  tasks = tmp_path_factory.mktemp("tasks")
  for name, docs, yaml in (("choice", CHOICE_DOCS, CHOICE_YAML), ("ppl", PPL_DOCS, PPL_YAML)):
    data = tasks / f"{name}.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tasks / f"{name}.yaml").write_text(yaml.format(path=data))
  trainer = LanguageModelTrainer(run_config(directory, "data_tensor"))
  tokens = np.zeros((trainer.config.batch_size, trainer.config.seq_len), np.int32)
  state = trainer.init_state(lm_batch(tokens))
  return directory, model, str(tasks), trainer, state


def _hf_loglikelihood(model, context, continuation, positions=32):
  """transformers' log-probability of `continuation` after `context` (the last `positions`
  tokens as inputs, the harness's HF model's truncation)."""
  whole = (context + continuation)[-(positions + 1):]
  ids = torch.tensor([whole[:-1]], dtype=torch.long)
  with torch.no_grad():
    log_probs = torch.log_softmax(model(ids).logits[0].double(), -1).numpy()
  targets = whole[1:]
  n = len(targets)
  return sum(log_probs[n - len(continuation) + i, t] for i, t in enumerate(continuation))


def test_loglikelihoods_equal_transformers(setup):
  directory, model, _, trainer, state = setup
  lm = harness.HarnessLM.from_trainer(trainer, state, directory)
  requests = [Instance("loglikelihood", {}, (d["question"], " " + c), 0)
              for d in CHOICE_DOCS for c in d["choices"]]
  ours = lm.loglikelihood(requests)
  for request, (logprob, _) in zip(requests, ours, strict=True):
    context, continuation = lm._encode_pair(*request.args)
    want = _hf_loglikelihood(model, context, continuation)
    np.testing.assert_allclose(logprob, want, atol=ATOL, rtol=0, err_msg=str(request.args))
  # Greedy: whether every continuation token is the argmax, as transformers' logits say.
  context, continuation = lm._encode_pair("w1 w2", " w3")
  with torch.no_grad():
    best = int(model(torch.tensor([context])).logits[0, -1].argmax())
  (_, greedy), = lm.loglikelihood([Instance("loglikelihood", {}, ("w1 w2", " " + WORDS[
      best - 2]), 0)])
  assert greedy


def test_harness_metrics_are_what_the_loglikelihoods_give(setup):
  directory, model, tasks, trainer, state = setup
  lm = harness.HarnessLM.from_trainer(trainer, state, directory)
  results = harness.evaluate(lm, ["tiny_choice", "tiny_ppl"],
                             manager=harness.task_manager(tasks, builtin=False))
  scores = harness.scalar_metrics(results)
  acc, acc_norm = [], []
  for d in CHOICE_DOCS:
    lls = np.array([_hf_loglikelihood(model, *lm._encode_pair(d["question"], " " + c))
                    for c in d["choices"]])
    lengths = np.array([len(" " + c) for c in d["choices"]])
    acc.append(np.argmax(lls) == d["answer"])
    acc_norm.append(np.argmax(lls / lengths) == d["answer"])
  assert scores["harness/tiny_choice/acc"] == pytest.approx(np.mean(acc))
  assert scores["harness/tiny_choice/acc_norm"] == pytest.approx(np.mean(acc_norm))
  # Perplexity: the documents' log-likelihoods over the harness's rolling windows.
  from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
  total, words = 0.0, 0
  for d in PPL_DOCS:
    ids = lm.tok_encode(d["text"], add_special_tokens=False)
    windows = list(map(make_disjoint_window, get_rolling_token_windows(
        ids, prefix_token=lm.eot_token_id, max_seq_len=32, context_len=1)))
    total += sum(_hf_loglikelihood(model, a, b) for a, b in windows)
    words += len(d["text"].split())
  assert len(windows) > 1
  np.testing.assert_allclose(scores["harness/tiny_ppl/word_perplexity"],
                             np.exp(-total / words), rtol=1e-4)


def test_the_action_evaluates_during_training(setup):
  directory, _, tasks, trainer, state = setup
  writer = Recorder()
  action = harness.HarnessEval(trainer, writer, ["tiny_choice"], every_steps=2,
                               tokenizer=directory, include_path=tasks, builtin_tasks=False,
                               prompts=("w1 w2",), max_new_tokens=4)
  rng = np.random.default_rng(1)
  batches = [lm_batch(rng.integers(0, VOCAB, (trainer.config.batch_size,
                                              trainer.config.seq_len)).astype(np.int32))
             for _ in range(3)]
  specs = [str(x.sharding.spec) for x in jax_leaves(state.params)]
  assert any("model" in s for s in specs)  # Tensor parallel: the action keeps this layout.
  trainer.fit(batches, num_steps=3, state=state, actions=[action], writer=writer)
  assert {2, 3} <= set(writer.scalars)
  assert 0 <= writer.scalars[2]["harness/tiny_choice/acc"] <= 1
  assert "'w1 w2' -> " in writer.texts[3]["harness/generations"]
  table = writer.texts[3]["harness/samples/tiny_choice"].splitlines()
  assert table[0] == "| input | response | target | acc | acc_norm |" and len(table) == 2 + 4
  cells = [c.strip() for c in table[2].split("|")[1:-1]]  # The first document's row.
  assert cells[0] == "w1 w2 w3" and cells[1] in CHOICE_DOCS[0]["choices"] and cells[2] == "1"


def jax_leaves(tree):
  import jax
  return jax.tree.leaves(tree)


def test_unknown_tasks_are_refused_naming_where_it_looked(setup):
  _, _, tasks, trainer, _ = setup
  with pytest.raises(ValueError, match=r"\['no_such_task'\].*no built-in ones.*include_path"):
    harness.HarnessEval(trainer, Recorder(), ["no_such_task"], every_steps=1,
                        include_path=tasks, builtin_tasks=False)
