"""LoRA (`config.lora`): low-rank adapters beside chosen weights, the base weights frozen.

The adapters are Qwix's (`qwix.LoraProvider`): a weight `W` that a matched
module multiplies by gets `W_lora_a [inputs, rank]` and `W_lora_b [rank, outputs]`
(flattened over its input and output axes; stacked layers keep their leading
`layer` axis), and the product adds `alpha / rank * x @ A @ B`. `B` starts at
zero, so step 0 computes the base model. Qwix names each adapter's axes after
its weight's (A: the weight's first input axis, B: its first output axis), so a
rule table lays the adapters out as it lays out their weights.

`config.lora.targets` are regular expressions on parameter paths (`/`-joined,
as `config.freeze` writes them); each must match at least one weight. Every
parameter that is not an adapter is frozen: zero updates and no optimizer state
(`trainer.step.optim`), so the optimizer holds the adapters' moments only.
`merged` folds the adapters into their weights (`W + alpha / rank * A @ B`), what
an export writes.

Linen modules only: Qwix's NNX LoRA creates the adapters during an eager call of
the model, which a scanned or pipelined `NnxLayerStack` cannot host. Not under a
pipeline (a `stage` mesh axis): the pipelined stack applies its layers outside
Qwix's interception, so that is refused.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

import ml_collections
import numpy as np

#: The suffixes Qwix gives a weight's adapters.
SUFFIX_A, SUFFIX_B = "_lora_a", "_lora_b"
#: Every adapter's path.
ADAPTERS = r".*_lora_[ab]"
#: Every parameter that is not an adapter: what LoRA freezes.
BASE = r"(?!.*_lora_[ab]$).*"


@dataclasses.dataclass(frozen=True)
class Lora:
  """Which weights get adapters, of what rank and scale.

  Attributes:
    rank: the adapters' inner width.
    alpha: the scale numerator: the product adds `alpha / rank * x @ A @ B`.
    targets: regexes on parameter paths; the modules holding the matched weights get
      adapters on every weight they multiply by.
  """

  rank: int
  alpha: float
  targets: tuple[str, ...]

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict) -> Lora | None:
    """`config.lora` checked (None: rank 0, off).

    Raises:
      ValueError: naming the field, the value and what is accepted.
    """
    spec = config.lora
    targets = tuple(spec.targets)
    if spec.rank == 0:
      if targets:
        raise ValueError(f"config.lora.targets={targets} but config.lora.rank=0 (LoRA off); "
                         f"set config.lora.rank to a positive integer.")
      return None
    if not isinstance(spec.rank, int) or spec.rank < 1:
      raise ValueError(f"config.lora.rank={spec.rank!r} must be a positive integer "
                       f"(0: no LoRA).")
    if not isinstance(spec.alpha, int | float) or spec.alpha <= 0:
      raise ValueError(f"config.lora.alpha={spec.alpha!r} must be a positive number.")
    if not targets or not all(isinstance(t, str) for t in targets):
      raise ValueError(f"config.lora.targets={targets!r} must be regular expressions on "
                       f"parameter paths, e.g. ('.*attn/c_attn/kernel', '.*mlp/.*/kernel').")
    for t in targets:
      try:
        re.compile(t)
      except re.error as e:
        raise ValueError(f"config.lora.targets entry {t!r} is not a regular expression "
                         f"({e}).") from e
    if tuple(config.freeze):
      raise ValueError(f"config.freeze={tuple(config.freeze)} with config.lora: LoRA freezes "
                       f"every weight but the adapters already; leave config.freeze empty.")
    from strategies.pipeline import STAGE_AXIS
    if STAGE_AXIS in tuple(config.strategy.mesh_axes):
      raise ValueError(
          f"config.lora with config.strategy.mesh_axes={tuple(config.strategy.mesh_axes)}: a "
          f"pipelined layer stack applies its layers outside Qwix's interception, so the "
          f"adapters would not be applied; LoRA runs under layouts without a "
          f"{STAGE_AXIS!r} axis (data, FSDP, tensor parallel).")
    return cls(int(spec.rank), float(spec.alpha), targets)

  def matched(self, paths: list[str]) -> list[str]:
    """The parameter paths the targets match.

    Raises:
      ValueError: a target that matches no parameter (naming the parameters).
    """
    out = []
    for t in self.targets:
      hits = [p for p in paths if re.fullmatch(t, p)]
      if not hits:
        raise ValueError(f"config.lora.targets entry {t!r} matches no parameter; the "
                         f"parameters are {sorted(paths)}.")
      out += hits
    return sorted(set(out))

  def provider(self, paths: list[str]) -> Any:
    """The Qwix provider adapting the modules that hold the matched weights."""
    import qwix

    modules = sorted({p.rsplit("/", 1)[0] if "/" in p else "" for p in self.matched(paths)})
    return qwix.LoraProvider(module_path="|".join(re.escape(m) for m in modules),
                             rank=self.rank, alpha=self.alpha)

  def check_adapted(self, base_paths: list[str], paths: list[str]) -> None:
    """Every matched weight got its adapters.

    Raises:
      ValueError: a matched parameter that no product uses as its weight (a bias, a norm's
        scale): it has no adapters.
    """
    have = set(paths)
    missing = [p for p in self.matched(base_paths) if p + SUFFIX_A not in have]
    if missing:
      raise ValueError(f"config.lora.targets match {missing}, which no matrix product of "
                       f"the model takes as its weight (biases, norms and embedding lookups "
                       f"get no adapters); target kernels, e.g. '.*attn/.*/kernel'.")


def _leading_axes(w: np.ndarray, a: np.ndarray, b: np.ndarray, rank: int) -> int:
  """How many leading axes (stacked layers) the weight and its adapters share: A is
  `[*lead, inputs..., rank]`, B `[*lead, rank, outputs...]`."""
  for lead in range(min(a.ndim, b.ndim)):
    n = int(np.prod(b.shape[:lead]))
    if (a.shape[:lead] == b.shape[:lead] == w.shape[:lead] and a.shape[-1] == rank
        and b.shape[lead] == rank and (a.size // rank) * (b.size // rank) == w.size * n):
      return lead
  raise ValueError(f"adapters {a.shape} and {b.shape} of rank {rank} do not fit the weight "
                   f"{w.shape}")


def merged(values: Mapping[str, np.ndarray], lora: Mapping[str, Any]) -> dict[str, np.ndarray]:
  """`{path: array}` of one model with every adapter pair folded into its weight:
  `W + alpha / rank * A @ B`, reshaped to `W` (inputs first, as the products take it)."""
  values = dict(values)
  adapted = sorted(p[:-len(SUFFIX_A)] for p in values if p.endswith(SUFFIX_A))
  if not adapted:
    return values
  rank, alpha = int(lora["rank"]), float(lora["alpha"])
  for path in adapted:
    w = np.asarray(values[path])
    a = np.asarray(values.pop(path + SUFFIX_A), np.float64)
    b = np.asarray(values.pop(path + SUFFIX_B), np.float64)
    lead = _leading_axes(w, a, b, rank)
    delta = np.matmul(a.reshape(a.shape[:lead] + (-1, rank)),
                      b.reshape(b.shape[:lead] + (rank, -1)))
    values[path] = (w + alpha / rank * delta.reshape(w.shape)).astype(w.dtype)
  return values
