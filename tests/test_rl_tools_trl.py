"""Multi-turn rollouts with tools equal TRL 1.16's `GRPOTrainer(tools=...)` /
`environment_factory=...`: both driven by one scripted assistant (TRL's generation
replaced by the same script), on a Qwen-style tokenizer saved by `transformers` with TRL's
own Qwen 2.5 template. Compared: the prompt rendered with the tools, the completion ids
with the tool turns, the tool mask (as the loss weights), the calls and failures, the
rewards' advantages (the environment's `get_reward` among them), and the loss and every
weight's gradient (our model loaded from TRL's: a tiny Qwen2 with the Qwen template, a
tiny Llama with the Llama one; under single_device or FSDP)."""

import numpy as np
import pytest
import tool_setup as ts

G = 2
BUDGET = 96


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  root = tmp_path_factory.mktemp("tools_trl")
  directories = {kind: ts.save_model(ts.save(kind, root / kind), family)  # Each family's own.
                 for kind, family in (("qwen", "qwen2"), ("llama", "llama"))}
  keys = ("ash", "elm", "oak", "fir")
  return directories, {1: ts.write_records(root / "records.jsonl", keys=keys),
                     2: ts.write_records(root / "twice.jsonl", keys=keys * 2)}


def _turns(tokenizer, kind):
  """Each rollout's scripted assistant turns (8 rollouts: 4 prompts x G), in the family's
  tool-call format."""
  if kind == "qwen":
    call = ('<tool_call>\n{{"name": "{}", "arguments": {{"key": "{}"}}}}\n</tool_call>'
            '<|im_end|>')
    bad = '<tool_call>\n{"name": lookup, bad}\n</tool_call><|im_end|>'
  else:
    call = '{{"name": "{}", "parameters": {{"key": "{}"}}}}<|eot_id|>'
    bad = '{"name": "lookup", "parameters": {key: bad}}<|eot_id|>'
  end = tokenizer.eos_token
  enc = lambda text: tokenizer.encode(text.replace("<|im_end|>", end),  # noqa: E731
                                      add_special_tokens=False)
  long = enc("the value of oak is " * 40)
  return [
      [enc(call.format("lookup", "ash")), enc("The value is 7<|im_end|>")],
      [enc(call.format("lookup", "zzz")), enc(call.format("search", "ash")),
       enc("I do not know<|im_end|>")],  # A failing call, then an unknown tool.
      [enc("It is 3<|im_end|>")],  # No call.
      [enc(bad)],  # Not JSON.
      [enc(call.format("lookup", "oak")), long],  # Cut at the budget after a tool turn.
      [enc(call.format("lookup", "oak")), enc(call.format("lookup", "elm")),
       enc("4<|im_end|>")],
      [enc("fir is 9<|im_end|>")],
      [enc(call.format("lookup", "fir")), enc("9<|im_end|>")],
  ]


class _TrlScript:
  """TRL's `_generate_single_turn` replaced: each sequence's next scripted turn."""

  def __init__(self, script):
    self.script, self.rows = script, None

  def __call__(self, prompt_ids, images, multimodal_fields, num_generations,
               has_tool_images=False):
    if self.rows is None:
      self.rows = [[list(p), 0] for p in prompt_ids]
      out = [self.script[r][0] for r in range(len(prompt_ids))]
      for r, ids in enumerate(out):
        self.rows[r][0] += ids
      return out, None
    out, used = [], set()
    for seq in prompt_ids:
      r = next(r for r, (prefix, _) in enumerate(self.rows)
               if r not in used and list(seq[:len(prefix)]) == prefix)
      used.add(r)
      turn = min(self.rows[r][1] + 1, len(self.script[r]) - 1)
      self.rows[r] = [list(seq) + self.script[r][turn], turn]
      out.append(self.script[r][turn])
    return out, None


def _trl(directory, records, script, tmp_path, *, environment, loss_type="dapo",
         iterations=None):
  import json

  import transformers
  from datasets import Dataset
  from trl import GRPOConfig, GRPOTrainer

  rows = [json.loads(line) for line in open(records)]
  args = GRPOConfig(output_dir=str(tmp_path / "trl"), report_to="none", use_cpu=True,
                    bf16=False, num_generations=G, per_device_train_batch_size=len(rows) * G,
                    max_completion_length=BUDGET, loss_type=loss_type,
                    max_tool_calling_iterations=iterations, disable_dropout=True)
  tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory))
  kwargs = dict(environment_factory=ts.TableEnv) if environment else dict(tools=[ts.lookup])
  trainer = GRPOTrainer(
      model=transformers.AutoModelForCausalLM.from_pretrained(str(directory)),
      reward_funcs=[ts.answered], args=args, train_dataset=Dataset.from_list(rows),
      processing_class=tokenizer, **kwargs)
  trainer._generate_single_turn = _TrlScript(script)
  inputs = [r for r in rows for _ in range(G)]
  trainer.model.train()
  out = trainer._generate_and_score_completions(inputs)
  metrics = {k: v[-1] for k, v in trainer._metrics["train"].items() if v}
  trainer.current_gradient_accumulation_steps = 1
  loss = trainer._compute_loss(trainer.model, out)
  loss.backward()
  metrics["loss"] = float(loss.detach())
  metrics["grads"] = {n: p.grad.detach().numpy() for n, p in trainer.model.named_parameters()
                      if p.grad is not None}
  return out, metrics


def _ours(directory, records, script, layout, *, environment, prompts, loss_type="dapo",
          iterations=None, tmp_path=None):
  import os

  import jax
  import ml_collections
  from safetensors.numpy import load_file

  from trainer.checkpoint.init_from import variables_by_collection
  from trainer.interop import hf
  from trainer.language_model import model_fields
  from trainer.rl import RLTrainer
  from trainer.rl import data as rl_data

  overrides = {"rl.max_completion_length": BUDGET, "batch_size": prompts,
               "rl.loss": loss_type, "rl.max_tool_calling_iterations": iterations}
  if environment:
    overrides.update({"rl.tools": (), "rl.environment": f"{ts.__file__}:TableEnv"})
  config = ts.config(directory, records, layout, **overrides)
  config.model = ml_collections.ConfigDict(hf.model_fields(str(directory)))  # TRL's model.
  config.init_from.path = str(directory)
  trainer = RLTrainer(config)
  trainer.multi_turn.policy = ts.script_policy(script)
  batch = next(rl_data.from_config(config, epochs=1)())
  state = trainer.init_state(batch)
  placed = trainer.strategy.put_batch(batch)
  update = jax.jit(trainer.update_batch)(state, placed)

  def loss_fn(params):
    outputs, _ = trainer.apply_model(params, state.model_state, {"inputs": update["inputs"]},
                                     rngs=trainer.step_rngs(jax.random.PRNGKey(0)),
                                     train=False)
    return trainer.loss(outputs, update).mean()

  loss, grads = jax.jit(jax.value_and_grad(loss_fn))(state.params)
  grads = trainer.strategy.to_canonical(state.replace(params=grads)).params
  values = variables_by_collection(jax.device_get(grads), {}, linen=True)["params"]
  hf.export(values, model_fields(**config.model.to_dict()), str(tmp_path / "grads"))
  update = jax.tree.map(np.asarray, jax.device_get(update))
  return update, float(loss), load_file(os.path.join(tmp_path / "grads", "model.safetensors"))


@pytest.mark.parametrize("kind,layout,environment,loss_type,iterations", [
    ("qwen", "single_device", False, "dapo", None), ("qwen", "fsdp", True, "grpo", None),
    ("llama", "single_device", True, "grpo", 1)])
def test_rollouts_with_tools_equal_trls(files, kind, layout, environment, loss_type,
                                        iterations, tmp_path):
  from transformers import AutoTokenizer
  directories, records = files
  directory = directories[kind]
  copies = 2 if layout == "fsdp" else 1  # FSDP: a prompt for each of the 8 devices.
  records = records[copies]
  tokenizer = AutoTokenizer.from_pretrained(str(directory))
  script = _turns(tokenizer, kind) * copies
  theirs, metrics = _trl(directory, records, script, tmp_path, environment=environment,
                         loss_type=loss_type, iterations=iterations)
  update, loss, grads = _ours(directory, records, script, layout, environment=environment,
                              prompts=4 * copies, loss_type=loss_type,
                              iterations=iterations, tmp_path=tmp_path)
  prompt_mask = theirs["prompt_mask"].numpy().astype(bool)
  prompt_ids = [p[m].tolist() for p, m in zip(theirs["prompt_ids"].numpy(), prompt_mask,
                                               strict=True)]
  completion_mask = theirs["completion_mask"].numpy().astype(bool)
  completions = [c[m].tolist() for c, m in zip(theirs["completion_ids"].numpy(),
                                                completion_mask, strict=True)]
  loss_mask = (theirs["completion_mask"] * theirs["tool_mask"]).numpy()
  tokens = np.concatenate([update["inputs"], update["targets"][:, -1:]], axis=1)
  weights = update["completion_weights"]
  for r in range(len(script)):
    n = len(prompt_ids[r])
    assert tokens[r, :n].tolist() == prompt_ids[r], f"rollout {r}: the prompt"
    got = tokens[r, n:n + len(completions[r])].tolist()
    assert got == completions[r], f"rollout {r}: the completion with its tool turns"
    mask = weights[r, n - 1:n - 1 + len(completions[r])]
    np.testing.assert_array_equal(mask, loss_mask[r, :len(completions[r])],
                                  err_msg=f"rollout {r}: the tool mask")
    assert weights[r, n - 1 + len(completions[r]):].sum() == 0
  stats = update["tool_stats"]
  calls, failures = stats[:, 0].sum(), stats[:, 1].sum()
  assert calls / len(script) == pytest.approx(metrics["tools/call_frequency"])
  assert failures / calls == pytest.approx(metrics["tools/failure_frequency"])
  if iterations is None:
    assert (failures, calls) == (2 * copies, 7 * copies)  # Every kind of call is covered.
  want = theirs["advantages"].numpy()
  np.testing.assert_allclose(update["advantages"], want, rtol=1e-5, atol=1e-6)
  close(loss, metrics["loss"], "the loss")
  assert set(grads) == set(metrics["grads"])
  assert any(np.abs(g).max() > 1e-4 for g in grads.values())  # Rewards that differ.
  for name, g in grads.items():
    close(g, metrics["grads"][name], f"d loss / d {name}")


def close(a, b, name, tol=1e-5):
  """float32 on both sides: 1e-5 of the largest value is far above two libraries'
  reordered sums over one layer, and far below what a wrong mask or normaliser moves."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  scale = max(1.0, float(np.abs(b).max()))
  assert np.allclose(a, b, rtol=0, atol=tol * scale), (
      f"{name}: largest difference {float(np.abs(a - b).max()):.3g} (scale {scale:.3g})")
