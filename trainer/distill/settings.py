"""`config.distill`, checked before anything is built (`Distill.from_config`): the teacher,
the divergence, the share of on-policy batches and the completions' sampling.
"""

from __future__ import annotations

import dataclasses

import ml_collections

#: `config.distill.teacher_dtype`: the teacher's storage ('' its weights' own).
TEACHER_DTYPES = ("", "nf4", "int8")


@dataclasses.dataclass(frozen=True)
class Distill:
  """`config.distill`, checked."""

  teacher: str
  teacher_dtype: str
  beta: float
  temperature: float
  lmbda: float
  max_prompt_length: int
  max_completion_length: int

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict) -> Distill:
    """Raises:
      ValueError: naming the field, the value and what is accepted.
    """
    if "distill" not in config:
      raise ValueError("DistillationTrainer needs config.distill (configs/distill.py: "
                       "distill_fields()).")
    spec = config.distill

    def number(name, ok, accepted):
      value = spec[name]
      if isinstance(value, bool) or not isinstance(value, int | float) or not ok(value):
        raise ValueError(f"config.distill.{name}={value!r} must be {accepted}.")
      return float(value)

    beta = number("beta", lambda v: 0 <= v <= 1,
                  "a number in [0, 1] (0: forward KL, 1: reverse KL, between: the "
                  "generalized JSD)")
    lmbda = number("lmbda", lambda v: 0 <= v <= 1,
                   "a number in [0, 1] (the share of batches whose completions the student "
                   "samples; 1: always, TRL DistillationTrainer's)")
    temperature = number("temperature", lambda v: v > 0, "a number > 0")
    for name in ("max_prompt_length", "max_completion_length"):
      value = spec[name]
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"config.distill.{name}={value!r} must be an integer >= 1.")
    if not isinstance(spec.teacher, str) or not spec.teacher:
      raise ValueError(f"config.distill.teacher={spec.teacher!r} must name the teacher: a "
                       f"Hugging Face model directory or a run's workdir.")
    if spec.teacher_dtype not in TEACHER_DTYPES:
      raise ValueError(f"config.distill.teacher_dtype={spec.teacher_dtype!r} is not one of "
                       f"{TEACHER_DTYPES} ('': the weights' own dtype; nf4 or int8 as "
                       f"QLoRA's base).")
    if spec.max_prompt_length + spec.max_completion_length > config.model.max_len:
      raise ValueError(f"config.distill.max_prompt_length + max_completion_length = "
                       f"{spec.max_prompt_length + spec.max_completion_length} is more than "
                       f"config.model.max_len={config.model.max_len} positions.")
    from strategies.context import CONTEXT_AXIS
    from strategies.pipeline import STAGE_AXIS
    axes = tuple(config.strategy.mesh_axes)
    for axis, what in ((STAGE_AXIS, "a pipeline"), (CONTEXT_AXIS, "context parallelism")):
      if axis in axes and lmbda > 0:
        raise ValueError(f"config.strategy.mesh_axes={axes} with config.distill.lmbda="
                         f"{lmbda}: the student samples its completions in the train step, "
                         f"which cannot run under {what} (the {axis!r} axis); use "
                         f"single_device or sharded_data_parallel with data, fsdp and tensor "
                         f"axes, or lmbda=0 (the records' completions only).")
    return cls(spec.teacher, spec.teacher_dtype, beta, temperature, lmbda,
               int(spec.max_prompt_length), int(spec.max_completion_length))
