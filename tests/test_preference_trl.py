"""Preference losses equal TRL 1.16's on the same records: the tokens, the loss, the chosen
and rejected rewards and every weight's gradient.

Tiny random `transformers` Llama (BOS from its tokenizer) and GPT-2 (none) models are
loaded both here (`config.init_from.path`) and in TRL. TRL's `DPOTrainer` tokenizes the
records (text, and chat through the chat template) and gives the loss
(`compute_loss`) for sigmoid and ipo; `CPOTrainer(loss_type="simpo", cpo_alpha=0)` and
`ORPOTrainer` give theirs (`get_batch_loss_metrics`) for the same token ids. Ours is one
train step of plain SGD at learning rate 1 under the layout, so the gradient is the
parameters' change, exported to Hugging Face names by `trainer.interop.hf.export`.

The reference is the policy itself, or a different model (another random draw), handed to
TRL as `ref_model` and to our state as `PreferenceTrainState.reference`.

Tolerances: float32 log-probs summed over up to 64 targets of 2-layer models (each a
logsumexp over 320 logits) agree to ~1e-6 between the libraries' orders of summation;
1e-5 (relative to the largest value compared) bounds it with room and would miss no
wrong mask, shift or sign (each of which moves these values by >1e-2).
"""

import os
import pathlib

import jax
import ml_collections
import numpy as np
import pytest

pytest.importorskip("trl")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import preference_files as pf  # noqa: E402

from configs import preference  # noqa: E402
from trainer import metrics as metrics_lib  # noqa: E402
from trainer.interop import hf  # noqa: E402

SEQ_LEN, PAIRS = 64, 8
TOL = 1e-5
#: (loss, family, layout): every loss, family and layout, each loss under two of them.
CASES = [("sigmoid", "llama", "single_device"), ("sigmoid", "gpt2", "fsdp"),
         ("sigmoid", "llama", "data_tensor"), ("ipo", "gpt2", "data_tensor"),
         ("ipo", "llama", "fsdp"), ("simpo", "llama", "single_device"),
         ("simpo", "gpt2", "data_tensor"), ("orpo", "gpt2", "single_device"),
         ("orpo", "llama", "fsdp")]
LAYOUTS = {"single_device": None, "fsdp": "fsdp", "data_tensor": "data_tensor"}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
  """Per family: the policy's and a different reference's directories, and TRL's models."""
  root = tmp_path_factory.mktemp("preference_models")
  out = {}
  for family in ("llama", "gpt2"):
    pf.save_model(family, root / family / "policy", seed=0)
    pf.save_model(family, root / family / "reference", seed=1)
    out[family] = root / family
  return out


@pytest.fixture(scope="module")
def records(tmp_path_factory):
  root = tmp_path_factory.mktemp("preference_records")
  text, chat = pf.text_pairs(PAIRS), pf.chat_pairs(PAIRS)
  return {"text": (text, pf.write_jsonl(root / "text.jsonl", text)),
          "chat": (chat, pf.write_jsonl(root / "chat.jsonl", chat))}


def our_config(loss: str, layout: str, model_dir: pathlib.Path, source: pathlib.Path):
  from configs import lm
  config = preference.get_config("dpo")
  config.preference.loss = loss
  config.preference.beta = 0.5 if loss == "simpo" else 0.1
  config.model = ml_collections.ConfigDict(hf.model_fields(str(model_dir)))
  config.init_from.path = str(model_dir)
  config.data.update(sources=(str(source),), workers=0, lanes=1, shuffle_files=False)
  config.update(seq_len=SEQ_LEN, batch_size=PAIRS, eval_batch_size=PAIRS, num_train_steps=1,
                optimizer="sgd", learning_rate=1.0, weight_decay=0.0, grad_clip_norm=0.0)
  config.schedule.update(name="constant", warmup_steps=0)
  if LAYOUTS[layout] is None:
    config.strategy.name = "single_device"
  else:
    shape, axes, rules = lm.LAYOUTS[LAYOUTS[layout]]
    config.strategy.update(name="sharded_data_parallel", mesh_shape=shape, mesh_axes=axes,
                           logical_axis_rules=rules)
  return config


def hf_grads(params, fields, directory: str) -> dict[str, np.ndarray]:
  """A parameter-shaped tree (gradients) in HF names, through the export's mapping."""
  from safetensors.numpy import load_file

  from trainer.checkpoint.init_from import variables_by_collection
  values = variables_by_collection(jax.device_get(params), {}, linen=True)["params"]
  hf.export(values, fields, directory)
  return load_file(os.path.join(directory, "model.safetensors"))


def pairs_batch(config, source):
  from trainer.preference import data as pdata
  config = ml_collections.ConfigDict(config.to_dict())
  config.data.sources = (str(source),)
  iterator = pdata.from_config(config)
  return next(iterator()), pdata.encoder(config, iterator.tokenizer)


def ours(trainer, batch, family_dir, tmp_path, *, other_reference: bool):
  """Our loss, metrics and gradient (HF names) of one step on `batch`."""
  from trainer.language_model import model_fields
  from trainer.preference import PreferenceTrainer

  state = trainer.init_state(batch)
  if other_reference:
    ref_config = ml_collections.ConfigDict(trainer.config.to_dict())
    ref_config.init_from.path = str(family_dir / "reference")
    state = state.replace(reference=PreferenceTrainer(ref_config).init_state(batch).params)
  before = jax.device_get(trainer.strategy.to_canonical(state).params)
  new, outputs = trainer.compiled.train(state)(state, trainer.strategy.put_batch(batch))
  after = jax.device_get(trainer.strategy.to_canonical(new).params)
  grads = jax.tree.map(lambda b, a: (np.asarray(b, np.float64) - np.asarray(a, np.float64)
                                     ).astype(np.float32), before, after)
  metrics = metrics_lib.scalars(jax.device_get(outputs["metrics"]))
  return metrics, hf_grads(grads, model_fields(**trainer.config.model.to_dict()),
                           str(tmp_path / "grads"))


def trl_side(loss, family_dir, recs, *, other_reference: bool, tmp_path):
  """TRL's tokenized records, loss, rewards and gradients of the policy's weights."""
  from datasets import Dataset
  from trl import DPOConfig, DPOTrainer

  policy = transformers.AutoModelForCausalLM.from_pretrained(str(family_dir / "policy"))
  tokenizer = transformers.AutoTokenizer.from_pretrained(str(family_dir / "policy"))
  ref = (transformers.AutoModelForCausalLM.from_pretrained(str(family_dir / "reference"))
         if other_reference else None)
  # bf16=False: TRL defaults to bf16 autocast, which it applies to the reference alone here.
  common = dict(output_dir=str(tmp_path / "trl"), report_to="none", use_cpu=True, bf16=False,
                per_device_train_batch_size=PAIRS, max_length=SEQ_LEN + 1)
  dpo = DPOTrainer(model=policy, ref_model=ref, args=DPOConfig(
      loss_type=[loss if loss in ("sigmoid", "ipo") else "sigmoid"], beta=0.1, **common),
      train_dataset=Dataset.from_list(recs), processing_class=tokenizer)
  rows = [dpo.train_dataset[i] for i in range(PAIRS)]
  ids = [(r["prompt_ids"], r["chosen_ids"], r["rejected_ids"]) for r in rows]
  policy.zero_grad()
  if loss in ("sigmoid", "ipo"):
    out = dpo.compute_loss(dpo.model, dpo.data_collator(rows))
    logged = {k: v[-1] for k, v in (dpo._metrics["train"] | dpo._metrics["eval"]).items()}
    values = {"loss": float(out), **{k: logged[k] for k in (
        "rewards/chosen", "rewards/rejected", "logits/chosen", "logits/rejected")}}
  else:
    values = _cpo_or_orpo(loss, policy, tokenizer, recs, ids, common)
    out = values.pop("tensor")
  out.backward()
  grads = {name: p.grad.detach().numpy() for name, p in policy.named_parameters()
           if p.grad is not None}
  return ids, values, grads


def _cpo_or_orpo(loss, policy, tokenizer, recs, ids, common):
  from datasets import Dataset
  if loss == "simpo":
    from trl.experimental.cpo import CPOConfig, CPOTrainer
    trainer = CPOTrainer(model=policy, args=CPOConfig(
        loss_type="simpo", cpo_alpha=0.0, beta=0.5, simpo_gamma=0.5, **common),
        train_dataset=Dataset.from_list(recs), processing_class=tokenizer)
  else:
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer
    trainer = ORPOTrainer(model=policy, args=ORPOConfig(beta=0.1, **common),
                          train_dataset=Dataset.from_list(recs), processing_class=tokenizer)
  batch = {}
  for side, k in (("chosen", 1), ("rejected", 2)):
    seqs = [p + (c if k == 1 else j) for p, c, j in ids]
    labels = [[-100] * len(p) + list(c if k == 1 else j) for p, c, j in ids]
    width = max(map(len, seqs))
    batch[f"{side}_input_ids"] = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    batch[f"{side}_attention_mask"] = torch.tensor([[1] * len(s) + [0] * (width - len(s))
                                                    for s in seqs])
    batch[f"{side}_labels"] = torch.tensor([lab + [-100] * (width - len(lab))
                                            for lab in labels])
  out, metrics = trainer.get_batch_loss_metrics(policy, batch)
  return {"tensor": out, "loss": float(out), "rewards/chosen": metrics["rewards/chosen"],
          "rewards/rejected": metrics["rewards/rejected"]}


def close(a, b, name):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  scale = max(1.0, float(np.abs(b).max()))
  assert np.allclose(a, b, rtol=0, atol=TOL * scale), (
      f"{name}: largest difference {float(np.abs(a - b).max()):.3g} (scale {scale:.3g})")


@pytest.mark.parametrize("loss,family,layout", CASES)
def test_loss_rewards_and_gradients_equal_trl(loss, family, layout, models, records, tmp_path):
  from trainer.preference import PreferenceTrainer
  config = our_config(loss, layout, models[family] / "policy", records["text"][1])
  trainer = PreferenceTrainer(config)  # One compiled step for every batch below.
  references = (False, True) if loss in ("sigmoid", "ipo") else (False,)
  for kind in ("text", "chat"):
    recs, source = records[kind]
    batch, encoder = pairs_batch(config, source)
    for other in references:
      ids, theirs, their_grads = trl_side(loss, models[family], recs, other_reference=other,
                                          tmp_path=tmp_path)
      assert [encoder.tokenize(r)[1] for r in recs] == [tuple(map(list, t)) for t in ids], (
          f"{kind} records tokenized unlike TRL's DPOTrainer")
      metrics, grads = ours(trainer, batch, models[family], tmp_path, other_reference=other)
      where = f"{loss}/{family}/{layout}/{kind}/{'other' if other else 'same'} reference"
      for name in theirs:  # The loss and rewards; DPO's and IPO's logits' means too.
        close(metrics[name], theirs[name], f"{where}: {name}")
      close(metrics["grad_norm"], np.sqrt(sum(float((g.astype(np.float64) ** 2).sum())
                                              for g in their_grads.values())),
            f"{where}: grad_norm")
      assert set(grads) <= set(their_grads), sorted(set(grads) - set(their_grads))
      assert any(np.abs(g).max() > 1e-4 for g in their_grads.values())
      for name, g in grads.items():
        close(g, their_grads[name], f"{where}: d loss / d {name}")


def test_an_export_after_lora_dpo_loads_in_transformers_with_our_logits(models, records,
                                                                        tmp_path):
  """DPO on the Llama with LoRA adapters (the reference the base, adapters off), saved and
  exported as any fine-tune is: `transformers` loads it and computes our logits."""
  from trainer.checkpoint import Checkpointer
  from trainer.export import export_checkpoint
  from trainer.preference import PreferenceTrainer
  from trainer.preference import data as pdata

  config = our_config("sigmoid", "fsdp", models["llama"] / "policy", records["chat"][1])
  config.update(optimizer="adamw", learning_rate=1e-2, num_train_steps=3)
  config.lora.update(rank=4, alpha=8.0, targets=(".*self_attn/[qv]_proj/kernel",))
  trainer = PreferenceTrainer(config)
  assert trainer.preference.reference == "adapters_off"
  workdir = str(tmp_path / "run")
  checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"), every_steps=0,
                              async_save=False)
  result = trainer.fit(pdata.from_config(config), num_steps=3, checkpointer=checkpointer)
  checkpointer.close()
  out = str(tmp_path / "hf")
  export_checkpoint(workdir, out, config=config.to_dict())
  loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  tokens = next(pdata.from_config(config)())["inputs"][:, 0]
  with torch.no_grad():
    theirs = loaded(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
  canonical = trainer.strategy.to_canonical(result.state)
  ours_logits = jax.jit(lambda p, s: trainer.model_variables.apply(
      p, s, ((tokens,), {}), rngs={"dropout": jax.random.PRNGKey(0)}, train=False)[0])(
          canonical.params, canonical.model_state)
  before = transformers.AutoModelForCausalLM.from_pretrained(str(models["llama"] / "policy"))
  with torch.no_grad():
    start = before(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
  assert np.abs(theirs - start).max() > 1e-3  # The adapters trained, and were merged.
  np.testing.assert_allclose(np.asarray(ours_logits)[..., :pf.VOCAB], theirs, atol=1e-4)
