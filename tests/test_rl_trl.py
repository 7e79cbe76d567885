"""GRPO's advantages, loss and gradients (`trainer.rl.losses`) equal TRL 1.16's
`GRPOTrainer._compute_loss` on the same inputs, for each loss type.

4 prompts of one length x G=4 completions of different lengths (right-padded), fixed
rewards, and the old policy's and the reference's per-token log-probs from two other
random models; the policy is a tiny random Llama or GPT-2 made by `transformers`,
loaded here through `config.init_from.path`. Ours is the loss of `trainer.rl.losses`
on our model's log-probs, differentiated under single_device or FSDP (the parameters
laid out by the fine-tune's rule table); the gradient goes to HF names through
`trainer.interop.hf.export`. float32 throughout: the bound 1e-5 (relative to the
largest value) is far above the two libraries' reordered sums over 2 layers and far
below what a wrong mask, clip or normaliser moves (>1e-3).
"""

import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

pytest.importorskip("trl")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import preference_files as pf  # noqa: E402

from trainer.interop import hf  # noqa: E402
from trainer.rl import losses  # noqa: E402

PROMPTS, G, PROMPT_LEN, MAX_COMPLETION = 4, 4, 6, 8
TOL = 1e-5
REWARDS = np.array([1, 0, 0, 1, 0, 0, 0, 1, 1, 1, 1, 0.5, 0.2, 0.9, 0.1, 0.4], np.float32)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
  root = tmp_path_factory.mktemp("rl_models")
  for family in ("llama", "gpt2"):
    for i, name in enumerate(("policy", "old", "reference")):
      pf.save_model(family, root / family / name, seed=i)
  return root


def inputs(rng):
  prompt = rng.integers(3, pf.VOCAB, (PROMPTS, PROMPT_LEN)).repeat(G, axis=0)
  lengths = rng.integers(2, MAX_COMPLETION + 1, PROMPTS * G)
  completion = rng.integers(3, pf.VOCAB, (PROMPTS * G, MAX_COMPLETION))
  mask = (np.arange(MAX_COMPLETION)[None] < lengths[:, None]).astype(np.float32)
  return prompt.astype(np.int64), completion.astype(np.int64), mask


def hf_logps(model, prompt, completion):
  with torch.no_grad():
    logits = model(torch.tensor(np.concatenate([prompt, completion], 1))).logits
  logits = logits[:, PROMPT_LEN - 1:-1]
  return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[..., None])[..., 0]


def trl_loss(loss_type, beta, directory, prompt, completion, mask, advantages, old, ref,
             tmp_path):
  from datasets import Dataset
  from trl import GRPOConfig, GRPOTrainer

  policy = transformers.AutoModelForCausalLM.from_pretrained(str(directory / "policy"))
  tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory / "policy"))
  args = GRPOConfig(output_dir=str(tmp_path / "trl"), report_to="none", use_cpu=True,
                    bf16=False, loss_type=loss_type, beta=beta, epsilon=0.2,
                    epsilon_high=0.28, num_generations=G, per_device_train_batch_size=G,
                    max_completion_length=MAX_COMPLETION, disable_dropout=True)
  trainer = GRPOTrainer(model=policy, reward_funcs=[lambda completions, **_: [0.0] * len(
      completions)], args=args, train_dataset=Dataset.from_list([{"prompt": "a"}] * G),
      processing_class=tokenizer)
  trainer.current_gradient_accumulation_steps = 1
  batch = {"prompt_ids": torch.tensor(prompt), "prompt_mask": torch.ones(prompt.shape,
                                                                          dtype=torch.long),
           "completion_ids": torch.tensor(completion),
           "completion_mask": torch.tensor(mask, dtype=torch.long),
           "advantages": torch.tensor(advantages), "old_per_token_logps": old,
           "ref_per_token_logps": ref,
           "num_items_in_batch": torch.tensor(float(mask.sum()))}
  trainer.model.train()
  loss = trainer._compute_loss(trainer.model, batch)
  loss.backward()
  grads = {n: p.grad.detach().numpy() for n, p in trainer.model.named_parameters()
           if p.grad is not None}
  return float(loss), grads


def our_loss(loss_type, beta, directory, layout, prompt, completion, mask, advantages, old,
             ref, tmp_path):
  from safetensors.numpy import load_file

  from configs import finetune_lm, lm
  from trainer.checkpoint.init_from import variables_by_collection
  from trainer.language_model import LanguageModelTrainer, model_fields
  from trainer.preference.losses import token_logps

  config = finetune_lm.get_config("full")
  config.model = ml_collections.ConfigDict(hf.model_fields(str(directory / "policy")))
  config.init_from.path = str(directory / "policy")
  config.update(seq_len=PROMPT_LEN + MAX_COMPLETION, batch_size=PROMPTS * G)
  if layout == "single_device":
    config.strategy.name = "single_device"
  else:
    config.strategy.logical_axis_rules = lm.rules(embed="data")
  trainer = LanguageModelTrainer(config)
  tokens = np.concatenate([prompt, completion], 1).astype(np.int32)
  state = trainer.init_state({"inputs": tokens, "targets": tokens})

  def loss_fn(params):
    logits, _ = trainer.model_variables.apply(
        params, state.model_state, ((jnp.asarray(tokens),), {}),
        rngs={"dropout": jax.random.PRNGKey(0)}, train=False)
    logps = token_logps(logits[:, PROMPT_LEN - 1:-1], jnp.asarray(completion, jnp.int32),
                        config.model.vocab_size)
    per_token = losses.per_token_loss(logps, jnp.asarray(old), jnp.asarray(advantages),
                                      epsilon=0.2, epsilon_high=0.28, ref_logps=jnp.asarray(ref),
                                      beta=beta)
    return losses.per_sequence(per_token, jnp.asarray(mask), loss_type,
                               max_completion_length=MAX_COMPLETION).mean()

  loss, grads = jax.jit(jax.value_and_grad(loss_fn))(state.params)
  grads = trainer.strategy.to_canonical(state.replace(params=grads)).params
  values = variables_by_collection(jax.device_get(grads), {}, linen=True)["params"]
  hf.export(values, model_fields(**config.model.to_dict()), str(tmp_path / "grads"))
  return float(loss), load_file(os.path.join(tmp_path / "grads", "model.safetensors"))


def close(a, b, name):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  scale = max(1.0, float(np.abs(b).max()))
  assert np.allclose(a, b, rtol=0, atol=TOL * scale), (
      f"{name}: largest difference {float(np.abs(a - b).max()):.3g} (scale {scale:.3g})")


def test_advantages_are_trls():
  rewards = torch.tensor(REWARDS)
  grouped = rewards.view(-1, G)
  theirs = (rewards - grouped.mean(1).repeat_interleave(G)) / (
      grouped.std(1).repeat_interleave(G) + 1e-4)  # torch's std: Bessel's correction.
  close(losses.group_advantages(jnp.asarray(REWARDS), G), theirs.numpy(), "group")
  close(losses.group_advantages(jnp.asarray(REWARDS), G, scale="none"),
        (rewards - grouped.mean(1).repeat_interleave(G)).numpy(), "none")
  # Completions without a reward (None from every function: NaN), as TRL leaves them out.
  from trl.trainer.utils import nanstd
  unscored = REWARDS.copy()
  unscored[[1, 5, 6, 12, 13, 14, 15]] = np.nan
  rewards = torch.tensor(unscored)
  grouped = rewards.view(-1, G)
  theirs = torch.nan_to_num((rewards - torch.nanmean(grouped, 1).repeat_interleave(G)) / (
      nanstd(grouped, dim=1).repeat_interleave(G) + 1e-4), nan=0.0)
  close(losses.group_advantages(jnp.asarray(unscored), G), theirs.numpy(), "group, None")


@pytest.mark.parametrize("loss_type,beta,family,layout", [
    ("grpo", 0.04, "llama", "single_device"), ("dr_grpo", 0.0, "gpt2", "fsdp"),
    ("dapo", 0.04, "gpt2", "single_device"), ("grpo", 0.0, "gpt2", "fsdp"),
    ("dr_grpo", 0.04, "llama", "fsdp"), ("dapo", 0.0, "llama", "fsdp")])
def test_loss_and_gradients_equal_trls_compute_loss(loss_type, beta, family, layout, models,
                                                    tmp_path):
  directory = models / family
  prompt, completion, mask = inputs(np.random.default_rng(0))
  old = hf_logps(transformers.AutoModelForCausalLM.from_pretrained(str(directory / "old")),
                 prompt, completion)
  ref = hf_logps(transformers.AutoModelForCausalLM.from_pretrained(
      str(directory / "reference")), prompt, completion)
  advantages = np.asarray(losses.group_advantages(jnp.asarray(REWARDS), G))
  theirs, their_grads = trl_loss(loss_type, beta, directory, prompt, completion, mask,
                                 advantages, old, ref, tmp_path)
  ours, grads = our_loss(loss_type, beta, directory, layout, prompt, completion, mask,
                         advantages, old.numpy(), ref.numpy(), tmp_path)
  close(ours, theirs, f"{loss_type} loss")
  assert any(np.abs(g).max() > 1e-4 for g in their_grads.values())
  for name, g in grads.items():
    close(g, their_grads[name], f"{loss_type}: d loss / d {name}")


def _trl_trainer(directory, tmp_path, reward_funcs, reward_weights=None):
  from datasets import Dataset
  from trl import GRPOConfig, GRPOTrainer

  args = GRPOConfig(output_dir=str(tmp_path / "trl"), report_to="none", use_cpu=True,
                    bf16=False, num_generations=G, per_device_train_batch_size=G,
                    reward_weights=reward_weights)
  return GRPOTrainer(
      model=transformers.AutoModelForCausalLM.from_pretrained(str(directory / "policy")),
      reward_funcs=reward_funcs, args=args,
      train_dataset=Dataset.from_list([{"prompt": "a"}] * G),
      processing_class=transformers.AutoTokenizer.from_pretrained(str(directory / "policy")))


@pytest.mark.parametrize("chat", [False, True])
def test_reward_functions_get_trls_arguments_and_none_is_trls(chat, models, tmp_path):
  """The keyword arguments TRL's `_calculate_rewards` passes a reward function, for records
  with more fields than the prompt (text or a conversation), are `rewards.arguments`' (less
  TRL's `log_extra`/`log_metric` callbacks and its state object), and a reward's None is
  left out of the weighted total as TRL leaves it (a NaN-aware sum; NaN where every
  function returned None)."""
  from trainer.rl import rewards
  records = [{"prompt": [{"role": "user", "content": "2+3="}] if chat else "2+3=",
              "answer": "5", "level": 3, "meta": {"source": "a", "tags": [1, 2]}},
             {"prompt": [{"role": "user", "content": "1+1="}] if chat else "1+1=",
              "answer": "2", "level": 1, "meta": {"source": "b", "tags": []}}]
  inputs = [r for r in records for _ in range(G)]
  texts = ["5", "x", "", "5 ", "2", "", "1", "22"]
  completion_ids = [[5], [6], [], [5, 7], [8], [], [9], [8, 8]]
  seen = []

  def recorder(**kwargs):
    seen.append(kwargs)
    return [float(len(c)) if c else None for c in kwargs["completion_ids"]]

  def digits_only(completions, **_):
    text = [c[0]["content"] if chat else c for c in completions]
    return [1.0 if t.strip().isdigit() else None for t in text]

  def never(completions, **_):
    return [None if i == 2 or i == 5 else 0.5 for i in range(len(completions))]

  trainer = _trl_trainer(models / "gpt2", tmp_path, [recorder, digits_only, never],
                         [1.0, 2.0, 0.5])
  completions = [[{"role": "assistant", "content": t}] for t in texts] if chat else texts
  theirs = trainer._calculate_rewards(inputs, [r["prompt"] for r in inputs], completions,
                                      completion_ids).numpy()
  ours = rewards.arguments(inputs, texts, prompt_field="prompt",
                           prompt_ids=[[1, 2]] * len(inputs), completion_ids=completion_ids)
  trl_kwargs = {k: v for k, v in seen[0].items() if k not in ("log_extra", "log_metric",
                                                              "trainer_state")}
  assert trl_kwargs == {k: v for k, v in ours.items() if k not in ("prompt_ids",
                                                                  "trainer_state")}
  funcs = [rewards.Reward("recorder", recorder, 1.0, "recorder"),
           rewards.Reward("digits_only", digits_only, 2.0, "digits_only"),
           rewards.Reward("never", never, 0.5, "never")]
  total, each = rewards.score(funcs, ours)
  np.testing.assert_array_equal(np.asarray([each[f.name] for f in funcs]).T, theirs)
  weights = torch.tensor([1.0, 2.0, 0.5])
  trl_total = (torch.tensor(theirs) * weights).nansum(1)
  trl_total[torch.isnan(torch.tensor(theirs)).all(1)] = torch.nan
  np.testing.assert_array_equal(np.asarray(total, np.float32), trl_total.numpy())
  assert np.isnan(total).sum() == 2  # Completions 2 and 5: no function applies.
