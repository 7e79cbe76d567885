"""LoRA adapters in PEFT's format: `adapter_config.json` + `adapter_model.safetensors`.

What `peft.PeftModel.from_pretrained(base, directory)` loads onto the `transformers` base
the run started from. Each adapted weight `W` (ours: inputs first, `A [inputs, rank]`,
`B [rank, outputs]` flattened over its axes, a stacked layer's `layer` axis leading) is
the HF tensor its family's rule writes (`trainer.interop.families`); PEFT's factors of
that tensor are `lora_A [rank, in]` and `lora_B [out, rank]`, with PEFT's scale
`lora_alpha / r`, ours. Which HF axis is the input (a `Linear`'s `[out, in]`, or GPT-2's
`Conv1D` `[in, out]`: PEFT's `fan_in_fan_out`) and where each of our input and output
positions lands on it are read off the rule's own conversion, applied to index codes, so
the mapping is the merged export's by construction.

`with_adapters` is the inverse: a PEFT adapter directory as our adapters, beside the base
`config.init_from.path` names, a run's starting point (`config.init_from.adapters`).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from trainer.step.lora import SUFFIX_A, SUFFIX_B

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
#: PEFT's prefix of every tensor name of a causal LM's adapters.
PREFIX = "base_model.model."


def _positions(conversion: Any, shape: tuple[int, ...], inputs: int, name: str):
  """Where our input and output positions land on the HF tensor: `(fan_in_fan_out, in
  positions, out positions)`, each positions array indexed by the HF axis.

  Raises:
    ValueError: the HF tensor mixes input and output axes (no PEFT factors).
  """
  n_in, n_out = math.prod(shape[:inputs]), math.prod(shape[inputs:])
  codes_in = np.broadcast_to(np.arange(n_in).reshape(shape[:inputs] + (1,) * (len(shape)
                                                                             - inputs)), shape)
  codes_out = np.broadcast_to(np.arange(n_out).reshape((1,) * inputs + shape[inputs:]), shape)
  hf_in, hf_out = conversion.to_hf(codes_in), conversion.to_hf(codes_out)
  if hf_in.ndim != 2:
    raise ValueError(f"PEFT: {name} is a {hf_in.ndim}-D HF tensor; PEFT's LoRA "
                     f"adapts 2-D weights only.")
  for in_axis in (1, 0):  # A Linear's [out, in], else a Conv1D's [in, out].
    if (hf_in == np.take(hf_in, [0], axis=1 - in_axis)).all() and (
        hf_out == np.take(hf_out, [0], axis=in_axis)).all():
      return (in_axis == 0, np.take(hf_in, 0, axis=1 - in_axis),
              np.take(hf_out, 0, axis=in_axis))
  raise ValueError(f"PEFT: {name}'s HF layout mixes the weight's input and output "
                   f"axes; PEFT's factors cannot hold its adapters.")


def _conversion(mapping: Any, rule: Any, shape: tuple[int, ...]) -> Any:
  """The rule's conversion for our one-layer weight shape `shape`."""
  from trainer.interop import hf
  return hf.Conversion(rule, mapping.dims, () if rule.split else tuple(
      shape[i] for i in np.argsort(rule.perm or range(len(shape)))))


def adapter_tensors(values: Mapping[str, np.ndarray], fields: Mapping[str, Any],
                    rank: int) -> tuple[dict[str, np.ndarray], list[str], bool]:
  """PEFT's tensors of one model's adapters (`values`: `{our path: array}`, the adapters
  and their weights), the adapted modules' names, and `fan_in_fan_out`.

  Raises:
    ValueError: a model of no mapped family, an adapted weight without an HF tensor, or
      weights of both HF layouts (PEFT's `fan_in_fan_out` is one setting).
  """
  from trainer.interop import families, hf
  from trainer.step.lora import _leading_axes

  family = families.get(fields["family"], field="config.model.family")
  fields = families.module_fields(**fields)
  mapping = hf.ResolvedRules(family, fields)
  rules = {rule.ours: rule for rule in mapping.rules}
  tensors, modules, layouts = {}, set(), set()
  for path in sorted(p[:-len(SUFFIX_A)] for p in values if p.endswith(SUFFIX_A)):
    if path not in rules:
      raise ValueError(f"PEFT export: the adapted weight {path!r} has no "
                       f"{family.model_type} tensor to go to.")
    rule, w = rules[path], np.asarray(values[path])
    a, b = np.asarray(values[path + SUFFIX_A]), np.asarray(values[path + SUFFIX_B])
    stack = mapping.stack(rule)
    shape = w.shape[len(stack):]
    conversion = _conversion(mapping, rule, shape)
    lead = _leading_axes(w, a, b, rank)
    n_in = math.prod(a.shape[lead:-1])
    inputs = next(k for k in range(1, len(shape) + 1) if math.prod(shape[:k]) == n_in)
    fan_in_fan_out, at_in, at_out = _positions(conversion, shape, inputs, rule.hf)
    layouts.add(fan_in_fan_out)
    a = a.reshape((-1, n_in, rank))
    b = b.reshape((-1, rank, math.prod(shape[inputs:])))
    for name, a_i, b_i in zip(mapping.hf_names(rule, family.prefix), a, b, strict=True):
      module = name.removesuffix(".weight")
      modules.add(module)  # Whole names: GPT-2's attn.c_proj is not its mlp.c_proj.
      tensors[f"{PREFIX}{module}.lora_A.weight"] = np.ascontiguousarray(a_i[at_in].T)
      tensors[f"{PREFIX}{module}.lora_B.weight"] = np.ascontiguousarray(b_i[:, at_out].T)
  if len(layouts) > 1:
    raise ValueError("PEFT export: the adapted weights mix HF's [out, in] and [in, out] "
                     "layouts; PEFT's fan_in_fan_out is one setting for all of them.")
  return tensors, sorted(modules), layouts == {True}


def export_adapters(values: Mapping[str, np.ndarray], fields: Mapping[str, Any],
                    lora: Mapping[str, Any], out_dir: str, *,
                    base: str | None = None, dtype: str | None = None) -> list[str]:
  """Writes one model's adapters (`values`, ours) as a PEFT adapter directory; returns
  the tensor names written. `lora`: `config.lora` (`rank`, `alpha`); `base`: the model
  directory they adapt (`base_model_name_or_path`)."""
  from safetensors.numpy import save_file

  rank, alpha = int(lora["rank"]), float(lora["alpha"])
  tensors, modules, fan_in_fan_out = adapter_tensors(values, fields, rank)
  if not tensors:
    raise ValueError("PEFT export: the checkpoint holds no LoRA adapters (config.lora.rank "
                     "was 0); export the model itself instead.")
  if dtype:
    tensors = {k: v.astype(dtype) for k, v in tensors.items()}
  config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
            "target_modules": modules, "lora_dropout": 0.0, "bias": "none",
            "fan_in_fan_out": fan_in_fan_out, "use_rslora": False, "use_dora": False,
            "inference_mode": True, "base_model_name_or_path": base}
  os.makedirs(out_dir, exist_ok=True)
  save_file(tensors, os.path.join(out_dir, WEIGHTS), metadata={"format": "pt"})
  with open(os.path.join(out_dir, CONFIG), "w") as f:
    json.dump(config, f, indent=2)
  return sorted(tensors)


def with_adapters(base: Any, directory: str, config: Any, *, linen: bool) -> Any:
  """The `init_from` source `base` (an HF model's, `config.init_from.path`) with the PEFT
  adapters in `directory` beside it, in our names and layouts (an NNX model's `W_lora_a
  [*inputs, rank]` and `W_lora_b [rank, *outputs]`; Qwix's, a Linen model's, flattened over
  the inputs and the outputs; a stacked layer's `layer` axis leading), so that a run
  starts from base and adapters alike.

  Raises:
    ValueError: naming the field: no base, a directory that is not a PEFT LoRA adapter, a
      rank or scale other than `config.lora`'s, or tensors no weight of the model takes.
  """
  import dataclasses

  from safetensors.numpy import load_file

  from trainer.interop import families, hf

  field = f"config.init_from.adapters={directory!r}"
  if base is None or base.num_members:
    raise ValueError(f"{field} needs the base model the adapters go onto in "
                     f"config.init_from.path (an HF model directory).")
  if not all(os.path.isfile(os.path.join(directory, f)) for f in (CONFIG, WEIGHTS)):
    raise ValueError(f"{field} holds no {CONFIG} and {WEIGHTS} (a PEFT adapter directory, "
                     f"as `save_pretrained` or `python -m trainer.export --adapters` writes).")
  with open(os.path.join(directory, CONFIG)) as f:
    spec = json.load(f)
  if spec.get("peft_type") != "LORA" or spec.get("use_dora") or spec.get("use_rslora"):
    raise ValueError(f"{field}: a {spec.get('peft_type')} adapter (use_dora="
                     f"{spec.get('use_dora')}, use_rslora={spec.get('use_rslora')}); plain "
                     f"LoRA is what config.lora computes.")
  rank, alpha = int(config.lora.rank), float(config.lora.alpha)
  if spec.get("r") != rank or float(spec.get("lora_alpha", -1)) != alpha:
    raise ValueError(f"{field} holds adapters of r={spec.get('r')}, lora_alpha="
                     f"{spec.get('lora_alpha')}; set config.lora.rank={spec.get('r')} and "
                     f"config.lora.alpha={spec.get('lora_alpha')} (now {rank}, {alpha}).")
  tensors = load_file(os.path.join(directory, WEIGHTS))
  fields = families.module_fields(**dict(config.model))
  family = families.get(fields["family"], field="config.model.family")
  mapping = hf.ResolvedRules(family, fields)
  values, used = {}, set()
  for rule in mapping.rules:
    names = [f"{PREFIX}{n.removesuffix('.weight')}.lora_{{}}.weight"
             for n in mapping.hf_names(rule, family.prefix)]
    present = [n.format("A") in tensors for n in names]
    if not any(present):
      continue
    if not all(present):
      raise ValueError(f"{field} adapts {rule.hf} in some layers only; this model's "
                       f"adapters cover every layer of a weight.")
    a = [tensors[n.format("A")] for n in names]  # [rank, in]
    b = [tensors[n.format("B")] for n in names]  # [out, rank]
    used.update(n.format(x) for n in names for x in "AB")
    hf_shape = ((b[0].shape[0], a[0].shape[1]) if not spec.get("fan_in_fan_out")
                else (a[0].shape[1], b[0].shape[0]))
    conversion = hf.Conversion(rule, mapping.dims, () if rule.split else hf_shape)
    shape = conversion.shape
    n_in = a[0].shape[1]
    inputs = next((k for k in range(1, len(shape)) if math.prod(shape[:k]) == n_in), None)
    if inputs is None:
      raise ValueError(f"{field}: {rule.hf}'s adapter takes {n_in} inputs, which no leading "
                       f"axes of our {rule.ours} {shape} make.")
    _, at_in, at_out = _positions(conversion, shape, inputs, rule.hf)
    ours_a = np.zeros((len(a), n_in, rank), a[0].dtype)
    ours_b = np.zeros((len(b), rank, math.prod(shape[inputs:])), b[0].dtype)
    ours_a[:, at_in, :] = np.stack([x.T for x in a])
    ours_b[:, :, at_out] = np.stack([x.T for x in b])
    stack = mapping.stack(rule)
    ins, outs = ((n_in,), (ours_b.shape[-1],)) if linen else (shape[:inputs], shape[inputs:])
    values[rule.ours + SUFFIX_A] = ours_a.reshape(stack + ins + (rank,))
    values[rule.ours + SUFFIX_B] = ours_b.reshape(stack + (rank,) + outs)
  left = sorted(set(tensors) - used)
  if left or not values:
    raise ValueError(f"{field}: {len(left)} tensor(s) go to no weight of this "
                     f"{family.model_type} model: {left[:6]}." if left else
                     f"{field} holds no LoRA tensors.")
  base_read, base_slice = base.read, base.read_slice

  def read(wanted):
    ours = {c: [p for p in ps if c == "params" and p in values] for c, ps in wanted.items()}
    out = base_read({c: [p for p in ps if p not in ours[c]] for c, ps in wanted.items()})
    out.setdefault("params", {}).update({p: values[p] for p in ours.get("params", [])})
    return out

  def read_slice(collection, path, index):
    if collection == "params" and path in values:
      return values[path][tuple(index)]
    return base_slice(collection, path, index)

  arrays = {c: dict(a) for c, a in base.arrays.items()}
  arrays.setdefault("params", {}).update({p: v.shape for p, v in values.items()})
  return dataclasses.replace(base, description=f"{base.description} with the PEFT adapters "
                             f"in {directory}", arrays=arrays, read=read,
                             read_slice=read_slice if base_slice is not None else None)
