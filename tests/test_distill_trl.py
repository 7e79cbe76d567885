"""Distillation's loss, every student weight's gradient and the logged entropy equal TRL
1.16's `DistillationTrainer._compute_loss` on the same prompts and completions.

A tiny random Llama teacher (wider and deeper than the students) and Llama and Qwen2
students made by `transformers`, sharing one tokenizer; 8 prompts of one length and
completions of 1 to 8 tokens (right-padded). For beta in {0, 0.5, 1} and temperature in
{1, 0.7}, ours is `DistillationTrainer.loss` (and `train_metrics`' entropy) on the
student's logits and the teacher's log-probs of the loaded models, differentiated under
single_device, FSDP or data x tensor; the gradient goes to HF names through
`trainer.interop.hf.export`. float32 throughout: the bound 1e-5 (relative to the largest
value) is far above reordered sums over 2-3 layers and a 320-token vocabulary, and far
below what a wrong mixture, temperature or normaliser moves (>1e-3).
"""

import dataclasses
import os

import jax
import numpy as np
import pytest

pytest.importorskip("trl")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import distill_setup  # noqa: E402
import preference_files as pf  # noqa: E402

ROWS, PROMPT_LEN, COMPLETION = 8, 6, 8
TOL = 1e-5
SETTINGS = [(beta, t) for beta in (0.0, 0.5, 1.0) for t in (1.0, 0.7)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
  return distill_setup.save_models(tmp_path_factory.mktemp("distill_models"))


def inputs():
  rng = np.random.default_rng(0)
  prompt = rng.integers(3, pf.VOCAB, (ROWS, PROMPT_LEN))
  completion = rng.integers(3, pf.VOCAB, (ROWS, COMPLETION))
  lengths = np.array([2, 8, 5, 3, 1, 7, 4, 6])
  mask = (np.arange(COMPLETION)[None] < lengths[:, None]).astype(np.int64)
  return prompt, completion, mask


def trl_values(root, student, tmp_path):
  """`{(beta, T): (loss, entropy, grads)}` from TRL's `_compute_loss`."""
  from datasets import Dataset
  from trl import DistillationConfig, DistillationTrainer

  prompt, completion, mask = inputs()
  batch = {"prompt_ids": torch.tensor(prompt), "prompt_mask": torch.ones(prompt.shape,
                                                                          dtype=torch.long),
           "completion_ids": torch.tensor(completion), "completion_mask": torch.tensor(mask)}
  out = {}
  for beta, temperature in SETTINGS:
    args = DistillationConfig(output_dir=str(tmp_path / "trl"), report_to="none", use_cpu=True,
                              bf16=False, beta=beta, temperature=temperature,
                              per_device_train_batch_size=ROWS,
                              max_completion_length=COMPLETION)
    trainer = DistillationTrainer(
        model=str(root / student), teacher_model=str(root / "teacher"), args=args,
        train_dataset=Dataset.from_list([{"prompt": "a"}] * ROWS),
        processing_class=transformers.AutoTokenizer.from_pretrained(str(root / student)))
    model = trainer.accelerator.unwrap_model(trainer.model)
    model.train()
    loss, entropy, count = trainer._compute_loss(model, batch, torch.tensor(mask.sum()))
    loss.backward()
    grads = {n: p.grad.detach().numpy() for n, p in model.named_parameters()
             if p.grad is not None}
    out[beta, temperature] = float(loss), float(entropy / count), grads
  return out


def our_values(root, student, layout, tmp_path):
  from safetensors.numpy import load_file

  from trainer.checkpoint.init_from import variables_by_collection
  from trainer.distill import DistillationTrainer
  from trainer.distill import trainer as distill_trainer
  from trainer.interop import hf
  from trainer.language_model import model_fields

  config = distill_setup.config(root, student, layout)
  trainer = DistillationTrainer(config)
  prompt, completion, mask = inputs()
  tokens = np.concatenate([prompt, completion], 1).astype(np.int32)
  state = trainer.init_state({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})
  weights = np.concatenate([np.zeros((ROWS, PROMPT_LEN - 1)), mask], 1).astype(np.float32)
  update = trainer.strategy.put_batch({
      "inputs": tokens[:, :-1], "targets": tokens[:, 1:], distill_trainer.WEIGHTS: weights,
      distill_trainer.ON_POLICY: np.ones(ROWS, np.float32),
      distill_trainer.CLIPPED: np.zeros(ROWS, np.float32)})
  out = {}
  for beta, temperature in SETTINGS:
    trainer.distill = dataclasses.replace(trainer.distill, beta=beta, temperature=temperature)

    def loss_fn(params, update):
      update = {**update, distill_trainer.TEACHER: trainer.teacher_logps(state,
                                                                          update["inputs"])}
      outputs, _ = trainer.apply_model(params, state.model_state, update,
                                       rngs=trainer.step_rngs(jax.random.PRNGKey(0)),
                                       train=True)
      losses = trainer.loss(outputs, update)
      entropy = trainer.train_metrics(outputs, update, losses).compute()["entropy"]
      return losses.mean(), entropy

    (loss, entropy), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(
        state.params, update)
    grads = trainer.strategy.to_canonical(state.replace(params=grads)).params
    values = variables_by_collection(jax.device_get(grads), {}, linen=True)["params"]
    directory = tmp_path / f"grads_{beta}_{temperature}"
    hf.export(values, model_fields(**config.model.to_dict()), str(directory))
    out[beta, temperature] = (float(loss), float(entropy),
                              load_file(os.path.join(directory, "model.safetensors")))
  return out


def close(a, b, name):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  scale = max(1.0, float(np.abs(b).max()))
  assert np.allclose(a, b, rtol=0, atol=TOL * scale), (
      f"{name}: largest difference {float(np.abs(a - b).max()):.3g} (scale {scale:.3g})")


@pytest.mark.parametrize("student,layout", [("llama", "single_device"), ("qwen2", "fsdp"),
                                            ("llama", "data_tensor")])
def test_loss_gradients_and_entropy_equal_trls(student, layout, models, tmp_path):
  theirs = trl_values(models, student, tmp_path)
  ours = our_values(models, student, layout, tmp_path)
  losses = {k: v[0] for k, v in theirs.items()}
  spread = np.diff(sorted(losses.values()))  # Each setting's loss far from the others'.
  assert spread.min() > 100 * TOL * max(losses.values()), sorted(losses.items())
  for key in SETTINGS:
    (loss, entropy, grads), (their_loss, their_entropy, their_grads) = ours[key], theirs[key]
    close(loss, their_loss, f"{key} loss")
    close(entropy, their_entropy, f"{key} entropy")
    assert any(np.abs(g).max() > 1e-6 for g in their_grads.values())
    assert set(grads) == set(their_grads)
    for name, g in grads.items():
      close(g, their_grads[name], f"{key}: d loss / d {name}")
