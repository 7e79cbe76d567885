"""A user's path across the parts, as the corpus guide tells it: text files and a tokenizer,
a training run, then generation, the harness and an export from the run's workdir alone,
and the export (weights, tokenizer and generation config) loaded by `transformers` with the
checkpoint's logits.

The commands are the guide's own (`doc_commands.user_path`), run in order as in a fresh
shell with few steps; no other test runs them again.
"""

import json
import re

import doc_commands as docs
import numpy as np
import pytest
from hf_fixtures import ATOL, our_outputs

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def path_run(tmp_path_factory):
  runner = docs.Runner(root=tmp_path_factory.mktemp("user_path"))
  outputs = {}
  for command in docs.user_path():
    result = runner.run(command)
    docs.check(command, result)
    outputs[docs.script_of(command)] = result
  return runner, outputs


def test_the_commands_use_the_runs_workdir_alone(path_run):
  runner, outputs = path_run
  assert list(outputs) == ["examples/write_corpus.py", "examples/transformer_lm.py",
                           "trainer.generate", "trainer.harness", "trainer.export"]
  # The workdir holds the config the run ran with, every override applied.
  written = json.loads(runner.path("/tmp/lm_corpus/config.json").read_text())
  assert written["model"]["family"] == "llama" and written["model"]["vocab_size"] == 512
  assert written["data"]["tokenizer"] == str(runner.path("/tmp/corpus"))
  assert written["num_train_steps"] == 2  # The tests' few-step flag, as the run took it.
  # What the commands print is theirs: no orbax INFO lines, each log line its own file.
  for script in ("trainer.generate", "trainer.export", "trainer.harness"):
    err = outputs[script].stderr
    assert not re.search(r"^I\d{4} .*(Checkpoint|orbax)", err, flags=re.M), (script, err)
    assert not re.search(r"^[IWE]\d{4} [\d:.]+ +\d+ __init__\.py:", err, flags=re.M), err


def test_the_export_loads_in_transformers_with_the_checkpoints_logits(path_run):
  runner, _ = path_run
  from trainer.data.corpus import Tokenizer
  from trainer.generate import build_trainer, restored_state, run_config

  export = runner.path("/tmp/lm_corpus_hf")
  hf_config = json.loads((export / "config.json").read_text())
  assert not [k for k, v in hf_config.items() if v is None]
  model = transformers.AutoModelForCausalLM.from_pretrained(str(export)).eval()
  assert type(model).__name__ == "LlamaForCausalLM"
  tokenizer = Tokenizer(str(runner.path("/tmp/corpus")), add_eos=False)
  text = "The tests make every command run with few steps"
  ids = np.asarray([tokenizer(text)[:12]], np.int32)
  # The tokenizer went with the weights: `transformers` loads it from the export alone,
  # and its generation config stops at the tokenizer's EOS.
  exported = transformers.AutoTokenizer.from_pretrained(str(export))
  assert exported(text)["input_ids"] == tokenizer(text).tolist()
  generation = transformers.GenerationConfig.from_pretrained(str(export))
  assert generation.eos_token_id == tokenizer.eos_id is not None
  trainer = build_trainer(run_config(str(runner.path("/tmp/lm_corpus")), None, None))
  ours = np.asarray(our_outputs(trainer, restored_state(trainer), ids))[..., :512]
  with torch.no_grad():
    theirs = model(torch.tensor(ids, dtype=torch.long)).logits.numpy()
  np.testing.assert_allclose(theirs, ours, atol=ATOL, rtol=0)
