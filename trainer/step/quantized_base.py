"""QLoRA's frozen base (`config.lora.base_dtype`): a LoRA run's base weights stored quantized.

A weight the patterns `config.lora.quantize` match (by default every `kernel`
but an output head's) is held in the train state as Qwix's quantized array,
`qwix.WithAux(QArray(qvalue, scale), how)`: NF4 codes (`uint4`, Qwix's NormalFloat
table) or `int8` values, with scales in the weight's own dtype, as Qwix quantizes a
product's weight: the last input (contracting) axis in blocks of
`config.lora.block_size`, one scale per block and output (and stacked layer); a
weight with several input axes (an attention output `[heads, head_dim, embed]`)
shares each scale across its other input axes. So the weight is
`dequantize(W_q) = table[qvalue] * scale`, and the adapted product is
`x @ (dequantize(W_q) + alpha / rank * A @ B)`.

Where the product happens (`trainer.step.lora`): Qwix's provider intercepts a Linen
module's products and dequantizes each weight where it is used, inside the scanned
layer stack; the backward pass keeps the dequantized weights it needs unless the
blocks are rematerialised (`config.remat`, per block: then one layer's at a time). An
NNX model, or any model under a pipeline, gets every quantized weight dequantized
before the call (`dequantized`), beside the adapters' fold: the step's temporaries hold
the whole base dequantized.

The codes are integers, so nothing differentiates them (`trainer.step.functions`
differentiates the inexact leaves only) and LoRA freezes them with the rest of the base.
Orbax cannot write 4-bit arrays: a checkpoint holds each `uint4`/`int4` array's codes
packed two per byte (`pack`, along its last axis of even length, low nibble first), and
restore unpacks them bitwise (`unpack`); the layout item records nothing else.

Loading a base from a checkpoint or a Hugging Face directory (`config.init_from`)
quantizes each device's shard as it is read, from the whole blocks that cover it
(`quantized_from`): no device holds a full-precision weight. An export
(`trainer.export`) writes the dequantized base with the adapters merged.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

PyTree = Any

#: `config.lora.base_dtype` values stored quantized: Qwix's qtype of each.
QTYPES = {"nf4": "nf4", "int8": jnp.int8}
#: `config.lora.base_dtype` values stored as plain arrays of another float dtype.
CASTS = {"bfloat16": jnp.bfloat16}
#: Every kernel but an output head's (`lm_head`, `head`): what `config.lora.quantize`
#: holds by default. Embeddings and norms are not products' weights.
DEFAULT_PATTERNS = (r"(?!(.*/)?(lm_head|head|logits)/).*kernel",)


def is_quantized(x: Any) -> bool:
  """Whether `x` is a quantized weight (Qwix's `WithAux` holding a `QArray`)."""
  from qwix._src.providers.ptq import WithAux
  return isinstance(x, WithAux)


@dataclasses.dataclass(frozen=True)
class BaseQuantization:
  """How a QLoRA run stores its frozen base.

  Attributes:
    dtype: `nf4` or `int8`.
    block_size: consecutive values of a weight's last input axis that share a scale.
    patterns: regexes on parameter paths of the weights stored quantized.
  """

  dtype: str
  block_size: int
  patterns: tuple[str, ...]
  #: How a refusal names the block size's field and the way out (a distillation teacher's
  #: are `config.distill`'s).
  names: dict = dataclasses.field(default_factory=dict, compare=False, hash=False)

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict) -> BaseQuantization | None:
    """`config.lora`'s base storage, checked (None: the weights' own dtype).

    Raises:
      ValueError: naming the field, the value and what is accepted.
    """
    spec = config.lora
    if spec.base_dtype == "":
      return None
    if spec.base_dtype not in {**QTYPES, **CASTS}:
      raise ValueError(f"config.lora.base_dtype={spec.base_dtype!r} is not a storage type "
                       f"of the frozen base; accepted: '' (the weights' own), "
                       f"{', '.join(repr(k) for k in {**QTYPES, **CASTS})}.")
    if not spec.rank:
      raise ValueError(f"config.lora.base_dtype={spec.base_dtype!r} needs adapters to train: "
                       f"set config.lora.rank and config.lora.targets (QLoRA), or leave "
                       f"config.lora.base_dtype=''.")
    if not isinstance(spec.block_size, int) or spec.block_size < 2 or spec.block_size % 2:
      raise ValueError(f"config.lora.block_size={spec.block_size!r} must be an even integer "
                       f">= 2 (values per scale; 64 is QLoRA's).")
    patterns = tuple(spec.quantize)
    from trainer.step.weights import check_patterns
    check_patterns("config.lora.quantize", patterns, tuple(map(repr, DEFAULT_PATTERNS)))
    return cls(spec.base_dtype, int(spec.block_size), patterns)

  @property
  def quantized(self) -> bool:
    """Whether the base is stored as Qwix's quantized arrays (else cast: `CASTS`)."""
    return self.dtype in QTYPES

  @property
  def qtype(self) -> Any:
    return QTYPES[self.dtype]

  def cast(self, params: dict) -> dict:
    """`params` with the weights the patterns match cast to `CASTS[dtype]` (boxes kept)."""
    import flax.linen as nn

    from strategies.tree import keypath_str
    dtype = CASTS[self.dtype]
    boxes = lambda x: isinstance(x, nn.meta.AxisMetadata)  # noqa: E731
    paths = [keypath_str(p, drop_box=True)
             for p, _ in jax.tree_util.tree_leaves_with_path(params, is_leaf=boxes)]
    chosen = set(self.matched(paths))

    def leaf(path, x):
      if keypath_str(path, drop_box=True) not in chosen:
        return x
      return x.replace(value=x.value.astype(dtype)) if boxes(x) else x.astype(dtype)
    return jax.tree_util.tree_map_with_path(leaf, params, is_leaf=boxes)

  def matched(self, paths: Iterable[str]) -> list[str]:
    """The parameter paths stored quantized.

    Raises:
      ValueError: an adapter matched (it trains), or a pattern that matches nothing.
    """
    from trainer.step.weights import matched_paths
    out = matched_paths("config.lora.quantize", self.patterns, list(paths))
    self.refuse_training(out)
    return out

  def refuse_training(self, paths: Iterable[str]) -> None:
    """Raises if the patterns match an adapter (it trains; only the frozen base is stored
    quantized)."""
    from trainer.step.weights import SUFFIX_A, SUFFIX_B
    training = sorted(q for q in paths if q.endswith((SUFFIX_A, SUFFIX_B))
                      and any(re.fullmatch(p, q) for p in self.patterns))
    if training:
      raise ValueError(f"config.lora.quantize matches {training}, which train (LoRA's "
                       f"adapters); only the frozen base is stored quantized: make the "
                       f"patterns match base weights only.")

  def how(self, path: str, shape: tuple[int, ...], lead: int, inputs: int) -> Any:
    """Qwix's `HowToQuantize` of a weight `[*lead, *inputs, *outputs]`, as Qwix quantizes a
    product's weight: its last input axis tiled by `block_size`, the leading and output
    axes channelwise, other input axes sharing the scale.

    Raises:
      ValueError: the block size does not divide the last input axis.
    """
    from qwix._src.core import qarray

    axis = lead + inputs - 1
    check_divides(path, shape, axis, self.block_size, **self.names)
    return qarray.HowToQuantize(
        qtype=self.qtype,
        channelwise_axes=[a for a in range(len(shape)) if a < lead or a > axis],
        tiled_axes={axis: self.block_size})


def check_divides(path: str, shape: tuple[int, ...], axis: int, block_size: int, *,
                  field: str = "config.lora.block_size",
                  otherwise: str = "leave the weight out of config.lora.quantize") -> None:
  """Refuses a block size that does not divide a weight's input axis, naming `field`."""
  if shape[axis] % block_size:
    ok = [d for d in range(2, shape[axis] + 1, 2) if shape[axis] % d == 0]
    raise ValueError(f"{field}={block_size} does not divide {path}'s input "
                     f"dimension {shape[axis]} (axis {axis} of its shape {tuple(shape)}); "
                     f"block sizes that divide it: {ok}, or {otherwise}.")


def probe_provider(base: BaseQuantization, paths: list[str]) -> Any:
  """A Qwix provider giving rank-1 adapters to the modules holding the weights `base`
  matches: the adapters' shapes say which axes of each weight its products take."""
  import qwix

  from trainer.step.weights import _any_of, _modules
  return qwix.LoraProvider(module_path=_any_of(_modules(base.matched(paths))), rank=1,
                           alpha=1.0)


def linen_weights(base: BaseQuantization, shapes: Mapping[str, tuple[int, ...]],
                  probed: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, int]]:
  """`{path: (leading axes, input axes)}` of the weights `base` matches, from the rank-1
  adapters `probe_provider` gave them (`probed`: the probe model's parameter shapes),
  each weight's block size checked.

  Raises:
    ValueError: a matched parameter no product takes as its weight, or a block size that
      does not divide a weight's last input axis.
  """
  from trainer.step.weights import SUFFIX_A, SUFFIX_B, _leading_axes

  out, missing = {}, []
  for path in base.matched(shapes):
    if path + SUFFIX_A not in probed:
      missing.append(path)
      continue
    w = shapes[path]
    a, b, = (jax.ShapeDtypeStruct(probed[path + s], jnp.int8) for s in (SUFFIX_A, SUFFIX_B))
    lead = _leading_axes(jax.ShapeDtypeStruct(w, jnp.int8), a, b, 1)
    fan_in = int(np.prod(a.shape[lead:-1]))
    inputs = next(k for k in range(1, len(w) - lead + 1)
                  if int(np.prod(w[lead:lead + k])) == fan_in)
    check_divides(path, w, lead + inputs - 1, base.block_size, **base.names)
    out[path] = (lead, inputs)
  if missing:
    raise ValueError(f"config.lora.quantize matches {missing}, which no matrix product of "
                     f"the model takes as its weight (biases, norms and embedding lookups "
                     f"are not stored quantized); match kernels, e.g. {DEFAULT_PATTERNS}.")
  return out


def quantize(params: dict, weights: Mapping[str, tuple[int, int]], base: BaseQuantization
             ) -> dict:
  """`params` (nested dicts, boxed where annotated) with each weight `base` matches replaced
  by its quantized array, boxed with the weight's names (the scale's tiled axis unnamed).

  Args:
    weights: `{path: (leading axes, input axes)}` of the products' weights.

  Raises:
    ValueError: a matched parameter that is not a product's weight, or a block size that
      does not divide its input axis.
  """
  import flax.linen as nn
  from qwix._src.core import qarray
  from qwix._src.providers.ptq import WithAux

  from trainer.step.weights import _at, matched_weights

  if not base.quantized:
    return base.cast(params)

  def boxes(x):
    return isinstance(x, nn.meta.AxisMetadata)

  params, matched = matched_weights(
      params, weights, base.matched,
      "config.lora.quantize matches {}, which no Linear or LinearGeneral layer takes as its "
      "kernel (biases, norms and embedding lookups are not stored quantized).")
  for path in matched:
    parent, name = _at(params, path)
    boxed = parent[name]
    w = boxed.value if boxes(boxed) else boxed
    lead, inputs = weights[path]
    how = base.how(path, tuple(w.shape), lead, inputs)
    q = qarray.quantize(w, how)
    if boxes(boxed):  # As Qwix boxes them: an axis the scale does not span is unnamed.
      names = tuple(n if k > 1 or d == 1 else None
                    for n, k, d in zip(boxed.names, q.scale.shape, w.shape, strict=True))
      q = q.replace(qvalue=boxed.replace(value=q.qvalue),
                    scale=boxed.replace(value=q.scale, names=names))
    parent[name] = WithAux(q, how)
  return params


def dequantized(params: PyTree) -> PyTree:
  """`params` (unboxed) with every quantized weight replaced by `dequantize(W_q)`."""
  import qwix
  return jax.tree.map(lambda x: qwix.dequantize(x.array) if is_quantized(x) else x, params,
                      is_leaf=is_quantized)


# -- Checkpoints: 4-bit codes packed two per byte -----------------------------------------


def _packed_axis(shape: tuple[int, ...]) -> int:
  for axis in reversed(range(len(shape))):
    if shape[axis] % 2 == 0:
      return axis
  raise ValueError(f"a 4-bit array of shape {tuple(shape)} has no axis of even length to "
                   f"pack two codes per byte along.")


def is_4bit(x: Any) -> bool:
  from strategies.tree import is_4bit as is_4bit_dtype
  return hasattr(x, "dtype") and is_4bit_dtype(x.dtype)


def packed_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
  axis = _packed_axis(shape)
  return shape[:axis] + (shape[axis] // 2,) + shape[axis + 1:]


def pack(x: jax.Array) -> jax.Array:
  """A 4-bit array's codes as `uint8`, two per byte along its last even axis (the even
  index in the low nibble)."""
  axis = _packed_axis(x.shape)
  bits = jax.lax.bitcast_convert_type(x, jnp.uint4) if x.dtype == jnp.int4 else x
  codes = bits.astype(jnp.uint8)
  pairs = codes.reshape(*x.shape[:axis], x.shape[axis] // 2, 2, *x.shape[axis + 1:])
  low, high = jnp.take(pairs, 0, axis=axis + 1), jnp.take(pairs, 1, axis=axis + 1)
  return low | (high << 4)


def unpack(packed: jax.Array, shape: tuple[int, ...], dtype: Any) -> jax.Array:
  """The 4-bit array of `shape` and `dtype` that `pack` stored as `packed`."""
  axis = _packed_axis(shape)
  low, high = packed & 0xF, packed >> 4
  codes = jnp.stack([low, high], axis=axis + 1).reshape(shape).astype(jnp.uint4)
  if np.dtype(dtype) == np.dtype(jnp.int4):
    return jax.lax.bitcast_convert_type(codes, jnp.int4)
  return codes


def packed_for_saving(tree: PyTree) -> PyTree:
  """`tree` with every 4-bit array's codes packed two per byte (`pack`)."""
  return jax.tree.map(lambda x: jax.jit(pack)(x) if is_4bit(x) else x, tree)


def packed_target(target: PyTree) -> PyTree:
  """A restore target of `jax.ShapeDtypeStruct` leaves with every 4-bit leaf replaced by the
  packed `uint8` array the checkpoint holds (sharded like it where the halved axis still
  divides, else whole along that axis)."""
  def packed(t):
    if not is_4bit(t):
      return t
    shape, sharding = packed_shape(tuple(t.shape)), getattr(t, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding):
      axis = _packed_axis(tuple(t.shape))
      spec = list(sharding.spec) + [None] * (len(shape) - len(sharding.spec))
      names = spec[axis] if isinstance(spec[axis], tuple) else (spec[axis],)
      ways = int(np.prod([sharding.mesh.shape[n] for n in names if n is not None]))
      if shape[axis] % ways:
        spec[axis] = None
        sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec))
    return jax.ShapeDtypeStruct(shape, jnp.uint8, sharding=sharding)
  return jax.tree.map(packed, target)


def unpacked(restored: PyTree, target: PyTree) -> PyTree:
  """The restored tree with each packed array unpacked to its target's 4-bit shape, dtype
  and sharding."""
  def leaf(x, t):
    if not is_4bit(t):
      return x
    sharding = getattr(t, "sharding", None)
    return jax.jit(lambda p: unpack(p, tuple(t.shape), t.dtype), out_shardings=sharding)(x)
  return jax.tree.map(leaf, restored, target)


def unpacked_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
  """The 4-bit array's shape that `pack` stored as `shape`: the axis it halved is the last
  one with only odd axes after it."""
  axis = len(shape) - 1
  while axis > 0 and shape[axis] % 2:
    axis -= 1
  return shape[:axis] + (2 * shape[axis],) + shape[axis + 1:]


def dequantized_values(values: Mapping[str, np.ndarray], base_dtype: str
                       ) -> dict[str, np.ndarray]:
  """`{path: array}` of a checkpoint's parameters as saved, with each quantized weight
  (`<w>/array/qvalue` and `<w>/array/scale`, its codes packed if 4-bit) replaced by the
  weight, `<w>: dequantize(W_q)` in its scale's dtype: what an export writes."""
  import qwix

  values = dict(values)
  for path in sorted(p for p in values if p.endswith("/array/qvalue")):
    weight = path[:-len("/array/qvalue")]
    codes, scale = np.asarray(values.pop(path)), np.asarray(values.pop(weight + "/array/scale"))
    values.pop(weight + "/array/zero_point", None)
    qtype = QTYPES[base_dtype]
    if qtype == "nf4":
      codes = unpack(jnp.asarray(codes), unpacked_shape(codes.shape), jnp.uint4)
    array = qwix.QArray(jnp.asarray(codes), jnp.asarray(scale), qtype=qtype)
    values[weight] = np.asarray(qwix.dequantize(array))
  return values


def quantized_from(read: Any, current: Any, target: Any) -> Any:
  """A quantized weight made on the devices from a source's float values, one shard at a
  time: each device's codes and scales are quantized from the whole blocks that cover its
  shard (`read(index)`: the float values at `index` of the weight), so no device or host
  holds the full-precision weight, and the result equals quantizing it whole.

  Args:
    current: the fresh quantized weight (its structure and qtype).
    target: its `jax.ShapeDtypeStruct` leaves with the shardings to make.
  """
  from qwix._src.core import qarray

  tq, ts = (jax.tree.leaves(y)[0] for y in (target.array.qvalue, target.array.scale))
  shape, scale_shape = tuple(tq.shape), tuple(ts.shape)
  tiles = [d // k for d, k in zip(shape, scale_shape, strict=True)]  # Values per scale.
  how = qarray.HowToQuantize(
      qtype=current.array.qtype, channelwise_axes=[a for a, t in enumerate(tiles) if t == 1],
      tiled_axes={a: t for a, t in enumerate(tiles) if 1 < t < shape[a]})

  def blocks(index, of_scale):
    """The weight's region of whole blocks under `index` (of the codes or the scales), and
    where `index` lies in it."""
    region, inside = [], []
    for a, entry in enumerate(tuple(index) + (slice(None),) * (len(shape) - len(index))):
      start, stop, _ = entry.indices(scale_shape[a] if of_scale else shape[a])
      if of_scale:
        region.append(slice(start * tiles[a], stop * tiles[a]))
        inside.append(slice(None))
      else:
        first = start // tiles[a] * tiles[a]
        region.append(slice(first, -(-stop // tiles[a]) * tiles[a]))
        inside.append(slice(start - first, stop - first))
    return tuple(region), tuple(inside)

  def make(index, of_scale):
    region, inside = blocks(index, of_scale)
    q = qarray.quantize(jnp.asarray(np.asarray(read(region)), ts.dtype), how)
    return np.asarray(q.scale if of_scale else q.qvalue[inside])

  codes = jax.make_array_from_callback(shape, tq.sharding, lambda i: make(i, False))
  scales = jax.make_array_from_callback(scale_shape, ts.sharding, lambda i: make(i, True))
  treedef = jax.tree.structure(current)
  return jax.tree.unflatten(treedef, [codes, scales])
