"""`config.rl`, checked before anything is built (`RL.from_config`): the loss, the
rollouts' sizes and sampling, the clipping, the KL and its reference, and the tool turns.
"""

from __future__ import annotations

import dataclasses
import sys

import ml_collections

from trainer.preference import reference as reference_lib
from trainer.rl import losses as losses_lib


@dataclasses.dataclass(frozen=True)
class RL:
  """`config.rl`, checked."""

  loss: str
  num_generations: int
  num_iterations: int
  beta: float
  epsilon: float
  epsilon_high: float
  scale_rewards: str
  max_prompt_length: int
  max_completion_length: int
  temperature: float
  reference: str  # "copy", "adapters_off" or "none" (beta 0).
  max_tool_calling_iterations: int = sys.maxsize  # None in the config: no limit.

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict) -> RL:
    """Raises:
      ValueError: naming the field, the value and what is accepted.
    """
    if "rl" not in config:
      raise ValueError("RLTrainer needs config.rl (configs/rl.py: rl_fields()).")
    spec = config.rl

    def number(name, ok, accepted):
      value = spec[name]
      if isinstance(value, bool) or not isinstance(value, int | float) or not ok(value):
        raise ValueError(f"config.rl.{name}={value!r} must be {accepted}.")
      return value

    if spec.loss not in losses_lib.LOSSES:
      raise ValueError(f"config.rl.loss={spec.loss!r} is not one of {losses_lib.LOSSES}.")
    if spec.scale_rewards not in losses_lib.SCALES:
      raise ValueError(f"config.rl.scale_rewards={spec.scale_rewards!r} is not one of "
                       f"{losses_lib.SCALES}.")
    g = number("num_generations", lambda v: isinstance(v, int) and v >= 2,
               "an integer >= 2 (a group's advantages compare its completions)")
    mu = number("num_iterations", lambda v: isinstance(v, int) and v >= 1, "an integer >= 1")
    beta = number("beta", lambda v: v >= 0, "a number >= 0 (0: no KL, no reference)")
    eps = number("epsilon", lambda v: v > 0, "a number > 0")
    eps_high = spec.epsilon_high if spec.epsilon_high is not None else eps
    if isinstance(eps_high, bool) or not isinstance(eps_high, int | float) or eps_high <= 0:
      raise ValueError(f"config.rl.epsilon_high={eps_high!r} must be a number > 0 (None: "
                       f"epsilon).")
    temperature = number("temperature", lambda v: v > 0, "a number > 0 (rollouts sample)")
    prompt = number("max_prompt_length", lambda v: isinstance(v, int) and v >= 1,
                    "an integer >= 1")
    completion = number("max_completion_length", lambda v: isinstance(v, int) and v >= 1,
                        "an integer >= 1")
    number("max_record_bytes", lambda v: isinstance(v, int) and v >= 2,
           "an integer >= 2 (each row carries its record as JSON, in up to this many bytes)")
    number("log_completions", lambda v: isinstance(v, int) and v >= 0,
           "an integer >= 0 (rows of the completions table; 0: none)")
    if prompt + completion > config.model.max_len:
      raise ValueError(f"config.rl.max_prompt_length={prompt} + max_completion_length="
                       f"{completion} = {prompt + completion} positions, more than the "
                       f"model's config.model.max_len={config.model.max_len}.")
    from strategies.context import CONTEXT_AXIS
    from strategies.pipeline import STAGE_AXIS
    axes = tuple(config.strategy.mesh_axes)
    for axis in (STAGE_AXIS, CONTEXT_AXIS):
      if axis in axes and config.strategy.name == "sharded_data_parallel":
        raise ValueError(f"config.strategy.mesh_axes={axes}: RL generates its rollouts in "
                         f"the train step, and the key/value cache cannot be split over the "
                         f"{axis!r} axis; it runs under single_device or "
                         f"sharded_data_parallel with data, fsdp and tensor axes.")
    iterations = spec.max_tool_calling_iterations
    if iterations is None:
      iterations = sys.maxsize
    elif isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 0:
      raise ValueError(f"config.rl.max_tool_calling_iterations={iterations!r} must be an "
                       f"integer >= 0 (tool turns a rollout may take), or None (no limit).")
    reference = "none"
    if beta:
      if spec.reference not in ("auto", "copy", "adapters_off"):
        raise ValueError(f"config.rl.reference={spec.reference!r} is not one of ('auto', "
                         f"'copy', 'adapters_off').")
      reference = reference_lib.resolve(spec.reference, config, field="config.rl.reference",
                                        otherwise="'copy'")
    return cls(spec.loss, g, mu, float(beta), float(eps), float(eps_high),
               spec.scale_rewards, prompt, completion, float(temperature), reference,
               iterations)
