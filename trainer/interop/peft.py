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

`read_adapters` is the inverse: a PEFT adapter directory as our adapters, a run's starting
point (`config.init_from.adapters`).
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
    raise ValueError(f"PEFT export: {name} is a {hf_in.ndim}-D HF tensor; PEFT's LoRA "
                     f"adapts 2-D weights only.")
  for in_axis in (1, 0):  # A Linear's [out, in], else a Conv1D's [in, out].
    if (hf_in == np.take(hf_in, [0], axis=1 - in_axis)).all() and (
        hf_out == np.take(hf_out, [0], axis=in_axis)).all():
      return (in_axis == 0, np.take(hf_in, 0, axis=1 - in_axis),
              np.take(hf_out, 0, axis=in_axis))
  raise ValueError(f"PEFT export: {name}'s HF layout mixes the weight's input and output "
                   f"axes; PEFT's factors cannot hold its adapters.")


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
    conversion = hf.Conversion(rule, mapping.dims, () if rule.split else tuple(
        w.shape[len(stack):][i] for i in np.argsort(rule.perm or range(w.ndim - len(stack)))))
    lead = _leading_axes(w, a, b, rank)
    n_in = math.prod(a.shape[lead:-1])
    shape = w.shape[len(stack):]
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
