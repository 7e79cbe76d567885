"""The teacher: a frozen model of its own, held in the train state beside the student.

`config.distill.teacher` names any model the project loads: a Hugging Face model directory
of one of the seven families, or a run's workdir (its `config.json` says the model, its
latest checkpoint holds the weights). It may be another family and size than the student;
its vocabulary must be the student's (refused before compute, naming both sizes).

Its variables are a field of the train state (`DistillTrainState.teacher`), made by the
teacher module's own init inside the state's init, so the strategy lays them out by the
run's rule table as it lays out the student's; then the source's arrays replace them,
each device's part read on its own (`trainer.checkpoint.loading.placed`). They are never
differentiated nor updated, and they are checkpointed with the state: a resumed run reads
them back from its checkpoint, not from the source.

`config.distill.teacher_dtype` stores the teacher's product weights as QLoRA stores its
base (`trainer.step.quantized_base`: NF4 or int8, in blocks of
`config.distill.teacher_block_size` along the input axis, quantized shard by shard as they
are read). The quantized products go through Qwix's LoRA
provider with rank-1 adapters whose `B` is zero, so the teacher computes exactly its
dequantized weights' products (the adapters hold `rank x (in + out)` values a weight).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

PyTree = Any


@dataclasses.dataclass
class Teacher:
  """The teacher's module and its variables' functions, and where its weights come from.

  Attributes:
    path: the teacher's directory (absolute).
    fields: its `config.model` fields (`trainer.language_model.model_fields`).
    variables: its `ModelVariables` (init, apply) as the student's.
    lora: the rank-1 adapters that carry a quantized teacher's products (None: plain).
  """

  path: str
  fields: dict
  variables: Any
  lora: Any = None

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict, *, vocab_multiple: int = 1
                  ) -> Teacher:
    """The teacher `config.distill` names, checked before anything is computed.

    Args:
      vocab_multiple: the layout's pieces of the `vocab` axis (the student's padding).

    Raises:
      ValueError: a teacher that does not exist or is not a model the project loads, one
        whose vocabulary is not the student's, or one with fewer positions than a row.
    """
    from models.attention import Method as AttentionMethod
    from trainer.language_model import language_model, model_fields
    from trainer.step import model_variables

    spec = config.distill
    path = os.path.abspath(os.path.expanduser(spec.teacher))
    fields = read_fields(path)
    if fields["vocab_size"] != config.model.vocab_size:
      raise ValueError(f"config.distill.teacher={spec.teacher!r} has a vocabulary of "
                       f"{fields['vocab_size']} tokens and the student "
                       f"(config.model.vocab_size) one of {config.model.vocab_size}: "
                       f"distillation compares their distributions token by token, so the "
                       f"two must share one vocabulary (one tokenizer).")
    need = spec.max_prompt_length + spec.max_completion_length
    max_len = fields.get("max_len")
    if fields["family"] in ("transformer", "gpt2") and max_len is not None and max_len < need:
      raise ValueError(f"config.distill.teacher={spec.teacher!r} has {max_len} positions; a "
                       f"row of config.distill.max_prompt_length + max_completion_length = "
                       f"{need} tokens needs as many.")
    fields = model_fields(**fields)
    fields["vocab_multiple"] = math.lcm(fields.get("vocab_multiple") or 1, vocab_multiple)
    lora = None
    if spec.teacher_dtype:
      from trainer.step.lora import Lora
      from trainer.step.quantized_base import DEFAULT_PATTERNS, BaseQuantization
      block = spec.teacher_block_size
      if isinstance(block, bool) or not isinstance(block, int) or block < 2 or block % 2:
        raise ValueError(f"config.distill.teacher_block_size={block!r} must be an even "
                         f"integer >= 2 (values per scale; 64 is QLoRA's).")
      lora = Lora(rank=1, alpha=1.0, targets=DEFAULT_PATTERNS, base=BaseQuantization(
          spec.teacher_dtype, block, DEFAULT_PATTERNS, names=dict(
              field="config.distill.teacher_block_size",
              otherwise="set config.distill.teacher_dtype=''")))
    variables = model_variables.create(language_model(**fields), lora=lora,
                                       attention=AttentionMethod.from_config(config))
    return cls(path, fields, variables, lora)

  def init(self, rng: jax.Array) -> PyTree:
    """Fresh teacher parameters (boxed with their logical axes; replaced by `load`)."""
    tokens = jnp.zeros((1, 2), jnp.int32)
    params, _ = self.variables.init({"params": rng, "dropout": rng}, ((tokens,), {}))
    return params

  def logits(self, params: PyTree, tokens: jax.Array) -> jax.Array:
    """The teacher's logits `[rows, length, vocab]` of `tokens`, without gradients."""
    outputs, _ = self.variables.apply(jax.lax.stop_gradient(params), {}, ((tokens,), {}),
                                   rngs={"dropout": jax.random.PRNGKey(0)}, train=False)
    from trainer.generation import logits_of
    return jax.lax.stop_gradient(logits_of(outputs))

  def load(self, state: PyTree, strategy: Any, abstract_state: PyTree) -> PyTree:
    """`state` with its teacher's variables read from the teacher's source, each device's
    part on its own (a quantized weight quantized from the whole blocks that cover it).

    Raises:
      ValueError: the source's arrays do not match the teacher's (path or shape).
    """
    from trainer.checkpoint import init_from, loading
    from trainer.run import shared

    source = init_from.open_source(self.path)
    num_members = strategy.checkpoint_layout()["num_members"]
    rules = ml_collections.ConfigDict(dict(
        init_from=dict(path=self.path, step=-1, member=-1, rules=(), fresh=(),
                       adapters=""),
        lora=dict(rank=1 if self.lora is not None else 0)))
    abstract = abstract_state.teacher
    plan = init_from.plan(rules, source, {"params": init_from.flat_weights(abstract)},
                          num_members=num_members, vocab=init_from.vocab_axes(abstract))
    target = strategy.checkpoint_target(abstract_state)
    current = strategy.checkpoint_state(state)
    teacher = loading.placed(plan, "params", current.teacher, target.teacher,
                               num_members=num_members,
                               held_once=shared.held_once(strategy, "teacher"))
    return strategy.from_checkpoint(current.replace(teacher=teacher))


def read_fields(path: str) -> dict:
  """The `config.model` fields of the model at `path`: an HF model directory's
  (`trainer.interop.hf.model_fields`) or a workdir's (its `config.json`'s `model`).

  Raises:
    ValueError: `path` does not exist or is neither.
  """
  from trainer.interop import hf
  accepted = ("a Hugging Face model directory (config.json and safetensors) or a run's "
              "workdir (config.json and checkpoints/)")
  if not os.path.exists(path):
    raise ValueError(f"config.distill.teacher={path!r} does not exist; it must be "
                     f"{accepted}.")
  if os.path.isdir(path) and hf.is_hf_checkpoint(path):
    return dict(hf.model_fields(path))
  config_path = os.path.join(path, "config.json")
  if os.path.isdir(os.path.join(path, "checkpoints")) and os.path.isfile(config_path):
    with open(config_path) as f:
      model = json.load(f).get("model")
    if isinstance(model, dict) and "vocab_size" in model:
      return {"family": "transformer", **{k: v for k, v in model.items() if v is not None}}
  raise ValueError(f"config.distill.teacher={path!r} cannot be loaded: it must be "
                   f"{accepted}.")


def teacher_bytes(abstract_teacher: PyTree) -> tuple[int, int]:
  """The teacher's bytes `(in all, on the device holding most)` in the layout its leaves'
  shardings give (4-bit codes at half a byte each, as a checkpoint packs them)."""

  def nbytes(count: int, dtype) -> int:
    dtype = jnp.dtype(dtype)
    return count // 2 if dtype.name in ("uint4", "int4") else count * dtype.itemsize

  total, per_device = 0, {}
  for leaf in jax.tree.leaves(abstract_teacher):
    total += nbytes(int(np.prod(leaf.shape)), leaf.dtype)
    for device, index in leaf.sharding.devices_indices_map(leaf.shape).items():
      part = int(np.prod([len(range(*s.indices(n)))
                          for s, n in zip(index, leaf.shape, strict=True)]))
      per_device[device] = per_device.get(device, 0) + nbytes(part, leaf.dtype)
  return total, max(per_device.values(), default=0)
