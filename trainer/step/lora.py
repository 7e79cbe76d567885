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

Two ways to apply them, one state: Qwix intercepts a Linen module's products
(`x @ W + alpha / rank * (x @ A) @ B`), where it can; an NNX model, or any model
under a pipeline (a `stage` mesh axis), gets the adapters folded into the weights it
is called with (`merge_adapters`: `x @ (W + alpha / rank * A @ B)`). Qwix's NNX LoRA
creates adapters during an eager call of the model, which a scanned or pipelined
`NnxLayerStack` cannot host; a pipelined `LayerStack` applies its layers outside
Qwix's interception. Folding works wherever the parameters go in: the adapters are
parameters beside their weights (`add_adapters`, for NNX's `Linear`/`LinearGeneral`
kernels; a Linen model's come from Qwix's init), named and laid out like them, and
the step differentiates through the fold. It costs a `W`-sized temporary per adapted
weight and, in the backward pass, the weight's full gradient (from which A's and B's
follow); Qwix's unfolded product needs neither.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from trainer.step.weights import (  # noqa: F401 -- LoRA's names, importable from here
    SUFFIX_A,
    SUFFIX_B,
    _any_of,
    _at,
    _leading_axes,
    _modules,
    check_patterns,
    matched_paths,
    matched_weights,
)

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
  #: Fold the adapters into the weights before the call (`merge_adapters`) instead of
  #: Qwix's interception: under a pipeline (NNX models always fold).
  fold: bool = False
  #: The frozen base's storage (`config.lora.base_dtype`; None: the weights' own dtype).
  base: Any = None

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
      from trainer.step.quantized_base import BaseQuantization
      BaseQuantization.from_config(config)  # Refuses a quantized base without adapters.
      return None
    if not isinstance(spec.rank, int) or spec.rank < 1:
      raise ValueError(f"config.lora.rank={spec.rank!r} must be a positive integer "
                       f"(0: no LoRA).")
    if not isinstance(spec.alpha, int | float) or spec.alpha <= 0:
      raise ValueError(f"config.lora.alpha={spec.alpha!r} must be a positive number.")
    check_patterns("config.lora.targets", targets,
                   ("'.*attn/c_attn/kernel'", "'.*mlp/.*/kernel'"))
    if tuple(config.freeze):
      raise ValueError(f"config.freeze={tuple(config.freeze)} with config.lora: LoRA freezes "
                       f"every weight but the adapters already; leave config.freeze empty.")
    from strategies.pipeline import STAGE_AXIS
    from trainer.step.quantized_base import BaseQuantization
    pipelined = STAGE_AXIS in tuple(config.strategy.mesh_axes)
    return cls(int(spec.rank), float(spec.alpha), targets, fold=pipelined,
               base=BaseQuantization.from_config(config))

  def matched(self, paths: list[str]) -> list[str]:
    """The parameter paths the targets match.

    Raises:
      ValueError: a target that matches no parameter (naming the parameters).
    """
    return matched_paths("config.lora.targets", self.targets, paths)

  def provider(self, paths: list[str]) -> Any:
    """The Qwix provider adapting the modules that hold the matched weights (and, with a
    quantized base, quantizing the weights of the modules `base` matches)."""
    import qwix

    adapted = _modules(self.matched(paths))
    if self.base is None or not self.base.quantized:  # A cast base: `Lora.base.cast`.
      return qwix.LoraProvider(module_path=_any_of(adapted), rank=self.rank, alpha=self.alpha)
    quantized = _modules(self.base.matched(paths))
    q = dict(weight_qtype=self.base.qtype, tile_size=self.base.block_size)
    groups = [(adapted & quantized, qwix.LoraRule, dict(rank=self.rank, alpha=self.alpha, **q)),
              (adapted - quantized, qwix.LoraRule, dict(rank=self.rank, alpha=self.alpha)),
              (quantized - adapted, qwix.QuantizationRule, q)]
    return qwix.LoraProvider([rule(module_path=_any_of(modules), **kwargs)
                              for modules, rule, kwargs in groups if modules])

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


# -- Adapters folded into the weights (NNX models; any model under a pipeline) -----------


def nnx_weights(model: Any) -> dict[str, tuple[int, int]]:
  """`{kernel path: (leading axes, input axes)}` of an NNX model's `Linear` and
  `LinearGeneral` kernels (a stacked layer's `layer` axis is a leading axis): the
  products whose weights can take adapters."""
  from flax import nnx

  out = {}
  for path, module in nnx.iter_modules(model):
    if isinstance(module, nnx.Linear):
      inputs, outputs = 1, 1
    elif isinstance(module, nnx.LinearGeneral):
      inputs, outputs = len(module.in_features), len(module.out_features)
    else:
      continue
    out["/".join(map(str, (*path, "kernel")))] = (module.kernel.ndim - inputs - outputs, inputs)
  return out


def add_adapters(params: dict, weights: Mapping[str, tuple[int, int]], lora: Lora,
                 rng: jax.Array) -> dict:
  """`params` (nested dicts, boxed where annotated) with `<w>_lora_a [*lead, *inputs, rank]`
  (He-uniform, as Qwix's) and `<w>_lora_b [*lead, rank, *outputs]` (zeros) beside every
  weight `w` the targets match, boxed with the weight's names (A: its leading and input
  axes', B: its leading and output axes'), so a rule table lays them out as the weight.

  Raises:
    ValueError: a matched parameter that is not a weight of `weights` (a bias, a norm, an
      embedding).
  """
  import flax.linen as nn

  params, matched = matched_weights(
      params, weights, lora.matched,
      "config.lora.targets match {}, which no Linear or LinearGeneral layer takes as its "
      "kernel (biases, norms and embedding lookups get no adapters); target kernels, e.g. "
      "'.*self_attn/.*/kernel'.")
  for path in matched:
    lead, inputs = weights[path]
    parent, name = _at(params, path)
    boxed = parent[name]
    w = boxed.value if isinstance(boxed, nn.meta.AxisMetadata) else boxed
    split = lead + inputs
    key = jax.random.fold_in(rng, zlib.crc32(path.encode()) & 0x7FFFFFFF)
    init = jax.nn.initializers.he_uniform(in_axis=tuple(range(lead, split)), out_axis=-1,
                                          batch_axis=tuple(range(lead)))
    a = init(key, (*w.shape[:split], lora.rank), w.dtype)
    b = jnp.zeros((*w.shape[:lead], lora.rank, *w.shape[split:]), w.dtype)
    if isinstance(boxed, nn.meta.AxisMetadata):
      names = tuple(boxed.names)
      a = boxed.replace(value=a, names=(*names[:split], None))
      b = boxed.replace(value=b, names=(*names[:lead], None, *names[split:]))
    parent[name + SUFFIX_A], parent[name + SUFFIX_B] = a, b
  return params


def merge_adapters(params: Any, lora: Lora) -> Any:
  """`params` (unboxed) with every adapter pair folded into its weight,
  `W + alpha / rank * A @ B`, and the adapters removed: what a model without adapters
  takes. The gradient flows through the fold to A and B."""
  if isinstance(params, Mapping):
    out = {}
    for key, value in params.items():
      if key.endswith((SUFFIX_A, SUFFIX_B)):
        continue
      if not isinstance(value, Mapping) and key + SUFFIX_A in params:
        a, b = params[key + SUFFIX_A], params[key + SUFFIX_B]
        lead = _leading_axes(value, a, b, lora.rank)
        delta = jnp.matmul(a.reshape(*a.shape[:lead], -1, lora.rank),
                           b.reshape(*b.shape[:lead], lora.rank, -1))
        value = value + (lora.alpha / lora.rank) * delta.reshape(value.shape).astype(value.dtype)
      out[key] = merge_adapters(value, lora)
    return out
  return params
