"""Hugging Face checkpoints in (`config.init_from.path`) and out (`python -m trainer.export`).

In: `init_from.path` may name an HF model directory (`config.json` with
`model.safetensors`, or the sharded `model.safetensors.index.json` form) or a
`.safetensors` file beside its `config.json`. `open_source` turns it into an
`init_from.Source` whose arrays carry this project's names and layouts (the
family's rules in `trainer.interop.families`), so `config.init_from`'s checks
apply: every HF tensor must be matched by a rule or known to hold no parameter,
every model parameter must come from one, shapes must agree, all refused before
any compute, with the names listed. Arrays are read slice by slice: each device
shard reads only its part of the tensor (safetensors' lazy slices), so under
FSDP no host materialises a whole weight matrix.

Out: `export(values, fields, out_dir)` writes `config.json` and `model.safetensors`
with HF's names and layouts, which `transformers` loads (`from_pretrained`).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from trainer.checkpoint.source import Source
from trainer.checkpoint.store import CheckpointError
from trainer.interop import families
from trainer.interop.families import Family, Rule

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


class SafetensorsFiles:
  """The tensors of one HF checkpoint (one file or the sharded form), opened lazily.

  Nothing is read until `read(name, index)`, which reads only `index`'s slice.
  """

  def __init__(self, path: str):
    """Opens the file(s) at `path`.

    Raises:
      CheckpointError: naming the file (and the tensor, where one is known): a file
        that is truncated or not safetensors, a shard the index names that is missing,
        or a tensor the index places in a shard that does not hold it.
    """
    weight_map = None
    if os.path.isfile(path):
      files = [path]
    elif os.path.isfile(os.path.join(path, INDEX)):
      index = os.path.join(path, INDEX)
      try:
        with open(index) as f:
          weight_map = {name: os.path.join(path, file)
                        for name, file in json.load(f)["weight_map"].items()}
      except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"config.init_from.path: the index {index} is not a "
                              f"safetensors index with a weight_map ({type(e).__name__}: "
                              f"{e}).") from e
      files = sorted(set(weight_map.values()))
    else:
      files = [os.path.join(path, WEIGHTS)]
    self.description = f"Hugging Face checkpoint {path}"
    self._handles = {file: _open(file, weight_map) for file in files}
    self.where = {name: file for file, h in self._handles.items() for name in h.keys()}
    for name, file in (weight_map or {}).items():
      if self.where.get(name) != file:
        held = f"; it is in {self.where[name]}" if name in self.where else ""
        raise CheckpointError(f"config.init_from.path: the index {os.path.join(path, INDEX)} "
                              f"places tensor {name!r} in {file}, which does not hold it"
                              f"{held}. The index and its shards do not belong together: "
                              f"copy the checkpoint again.")
    self.bytes_read = 0  # What `read` has returned in all, and in its largest call.
    self.largest_read = 0

  def names(self) -> list[str]:
    return sorted(self.where)

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self._handles[self.where[name]].get_slice(name).get_shape())

  def read(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
    file = self.where[name]
    try:
      tensor = self._handles[file].get_slice(name)
      x = np.asarray(tensor[index] if index else tensor[:])
    except Exception as e:  # safetensors' own errors name neither the file nor the tensor.
      raise CheckpointError(f"config.init_from.path: reading tensor {name!r} of {file} "
                            f"failed ({type(e).__name__}: {e}); the file is damaged.") from e
    self.bytes_read += x.nbytes
    self.largest_read = max(self.largest_read, x.nbytes)
    return x


def _open(file: str, weight_map: Mapping[str, str] | None):
  """A lazy handle of one safetensors file; refusals name the file (and what the index
  places in it)."""
  from safetensors import safe_open

  if not os.path.isfile(file):
    placed = sorted(n for n, f in (weight_map or {}).items() if f == file)
    where = (f"the index places {len(placed)} tensor(s) in it ({placed[:4]}"
             f"{' ...' if len(placed) > 4 else ''}), but it" if placed else "it")
    raise CheckpointError(f"config.init_from.path: {file} is missing: {where} does not "
                          f"exist.")
  try:
    return safe_open(file, framework="np")
  except Exception as e:  # SafetensorError: "incomplete metadata, file not fully covered"...
    raise CheckpointError(
        f"config.init_from.path: {file} ({os.path.getsize(file)} bytes) is not a readable "
        f"safetensors file ({type(e).__name__}: {e}): truncated or damaged; copy or "
        f"download it again.") from e


def _full(index: Sequence[Any] | None, shape: Sequence[int]) -> list[slice]:
  """`index` (from `make_array_from_callback`: slices, maybe fewer than axes) as one
  plain `slice(start, stop)` per axis."""
  index = list(index or ())
  index += [slice(None)] * (len(shape) - len(index))
  out = []
  for s, n in zip(index, shape, strict=True):
    start, stop, step = s.indices(n)
    if step != 1:
      raise ValueError(f"strided slice {s} of an axis of {n}")
    out.append(slice(start, stop))
  return out


class Conversion:
  """One rule resolved for one model: HF shape, split shape, permutation, our shape."""

  def __init__(self, rule: Rule, dims: Mapping[str, int], hf_shape: tuple[int, ...] = ()):
    """`hf_shape`: the checkpoint's (checked against the rule); () for the rule's own."""
    self.rule = rule
    width = lambda d: dims[d] if isinstance(d, str) else d  # noqa: E731
    if rule.split:
      groups = [tuple(map(width, g)) if isinstance(g, tuple) else (width(g),)
                for g in rule.split]
    else:
      groups = [(n,) for n in hf_shape]
    own = tuple(math.prod(g) for g in groups)
    if hf_shape and tuple(hf_shape) != own:
      raise ValueError(f"{rule.hf} has shape {tuple(hf_shape)}; the model's widths make it "
                       f"{own}")
    self.hf_shape = own
    self.split = tuple(n for g in groups for n in g)
    axes = iter(range(len(self.split)))
    self.groups = [[next(axes) for _ in g] for g in groups]
    self.perm = rule.perm or tuple(range(len(self.split)))
    self.shape = tuple(self.split[p] for p in self.perm)  # One layer's, in our layout.

  def read(self, files: SafetensorsFiles, name: str, index: Sequence[Any] | None) -> np.ndarray:
    """`ours[index]` of one layer, reading only the HF slice that covers it."""
    ours = _full(index, self.shape)
    want = [slice(None)] * len(self.split)  # The wanted slice of each split axis.
    for i, p in enumerate(self.perm):
      want[p] = ours[i]
    hf_index, local, sizes = [], [], []
    for a, group in enumerate(self.groups):
      first, rest = want[group[0]], [want[j] for j in group[1:]]
      inner = math.prod(self.split[j] for j in group[1:])
      start, stop, _ = first.indices(self.split[group[0]])
      if all(s == slice(None) or s.indices(self.split[j]) == (0, self.split[j], 1)
             for s, j in zip(rest, group[1:], strict=True)):
        hf_index.append(slice(start * inner, stop * inner))  # Contiguous on the HF axis.
        sizes += [stop - start] + [self.split[j] for j in group[1:]]
        local += [slice(None)] * len(group)
      else:
        hf_index.append(slice(0, self.hf_shape[a]))
        sizes += [self.split[j] for j in group]
        local += [want[j] for j in group]
    x = files.read(name, tuple(hf_index)).reshape(sizes)[tuple(local)]
    return np.transpose(x, self.perm)

  def to_hf(self, x: np.ndarray) -> np.ndarray:
    """One layer of ours -> the HF tensor (the inverse of `read`)."""
    return np.ascontiguousarray(np.transpose(x, np.argsort(self.perm)).reshape(self.hf_shape))


def _pattern(template: str, prefix: str) -> re.Pattern:
  body = (re.escape(template).replace(re.escape("{i}"), r"(?P<i>\d+)")
          .replace(re.escape("{e}"), r"(?P<e>\d+)"))
  return re.compile(f"(?:{re.escape(prefix)})?{body}" if prefix else body)


def is_hf_checkpoint(path: str) -> bool:
  """Whether `path` is an HF model directory (`config.json` beside safetensors weights) or a
  `.safetensors` file."""
  if os.path.isfile(path):
    return path.endswith(".safetensors")
  return os.path.isfile(os.path.join(path, CONFIG)) and any(
      os.path.isfile(os.path.join(path, name)) for name in (WEIGHTS, INDEX))


def read_config(path: str) -> dict[str, Any]:
  """The HF `config.json` of a model directory (or beside a `.safetensors` file)."""
  where = path if os.path.isdir(path) else os.path.dirname(path)
  config_path = os.path.join(where, CONFIG)
  if not os.path.isfile(config_path):
    raise ValueError(f"config.init_from.path={path!r}: a .safetensors file needs the model's "
                     f"{CONFIG} beside it (it says which architecture and widths it is).")
  with open(config_path) as f:
    return json.load(f)


def model_fields(path: str) -> dict[str, Any]:
  """`config.model`'s fields (`family` included) for the HF model at `path`: what
  `LanguageModelTrainer` builds the matching module from."""
  hf_config = read_config(path)
  return families.get(hf_config.get("model_type")).fields(hf_config)


#: `config.model` fields a run may choose apart from its checkpoint: the longest sequence
#: (GPT-2's position table is checked by shape; rope families compute any length) and
#: the dropout rate (training only; HF's export writes it).
RUN_CHOICES = ("max_len", "dropout_rate")


def check_model_config(model: Mapping[str, Any], path: str) -> None:
  """Refuses a `config.model` that computes something other than the HF checkpoint at
  `path`: every field its `config.json` gives (`model_fields`: family, widths, rope base and
  scaling, sliding window, norm epsilon, tied head, routing; the family fixes biases and
  q/k norms) must equal the run's, with the family's defaults filled in for fields left
  None. Only `RUN_CHOICES` may differ. Shapes alone would miss most of these.

  Raises:
    ValueError: naming the first field that differs and both values.
  """
  theirs = model_fields(path)
  family = model.get("family") or "transformer"
  if family != theirs["family"]:
    raise ValueError(
        f"config.model.family={family!r}, but config.init_from.path={path!r} is a "
        f"{theirs['family']!r} checkpoint (its config.json's model_type); set config.model "
        f"from the checkpoint: trainer.interop.hf.model_fields(path).")
  ours = families.module_fields(**dict(model))
  derived = {"head_dim": lambda f: f["embed_dim"] // f["num_heads"],  # What None computes.
             "moe_mlp_dim": lambda f: f["mlp_dim"]}
  for name, default in derived.items():
    if name in theirs and ours.get(name) is None:
      ours[name] = default(ours)
  for name, value in theirs.items():
    if name in RUN_CHOICES:
      continue
    mine = ours.get(name)
    if not _same(mine, value):
      raise ValueError(
          f"config.model.{name}={mine!r}, but the checkpoint at config.init_from.path="
          f"{path!r} has {name}={value!r} (from its config.json); the model would compute "
          f"something else than the weights were trained for. Set config.model.{name}="
          f"{value!r}, or set config.model from trainer.interop.hf.model_fields(path).")


def _same(a: Any, b: Any) -> bool:
  """Equal as config values: numbers by value (1e-5 == 1e-05, 4 == 4.0), mappings by key."""
  if isinstance(a, Mapping) and isinstance(b, Mapping):
    return set(a) == set(b) and all(_same(a[k], b[k]) for k in a)
  if isinstance(a, bool) or isinstance(b, bool):
    return bool(a) == bool(b) and type(a) is type(b)
  if isinstance(a, (int, float)) and isinstance(b, (int, float)):
    return float(a) == float(b)
  return a == b


class ResolvedRules:
  """The rules of a family resolved against one checkpoint's tensors (import), or against
  our model's fields alone (export)."""

  def __init__(self, family: Family, fields: Mapping[str, Any]):
    self.family, self.fields = family, dict(fields)
    self.dims = family.dims(fields)
    self.rules = family.rules(fields)
    self.num_layers = int(fields["num_layers"])
    self.num_experts = int(fields.get("num_experts") or 0)

  def stack(self, rule: Rule) -> tuple[int, ...]:
    """The leading axes a rule's tensors are stacked on: `layer` (`{i}`), then `expert`
    (`{e}`)."""
    return (((self.num_layers,) if rule.stacked else ())
            + ((self.num_experts,) if rule.per_expert else ()))

  def indices(self, rule: Rule) -> list[tuple[int, ...]]:
    """Every (layer[, expert]) index of a rule's tensors, in the stacked order."""
    return list(itertools.product(*map(range, self.stack(rule))))

  def hf_name(self, rule: Rule, index: tuple[int, ...], prefix: str = "") -> str:
    names = (["i"] if rule.stacked else []) + (["e"] if rule.per_expert else [])
    return prefix + rule.hf.format(**dict(zip(names, index, strict=True)))

  def hf_names(self, rule: Rule, prefix: str = "") -> list[str]:
    return [self.hf_name(rule, index, prefix) for index in self.indices(rule)]


def open_source(path: str):
  """The `init_from.Source` of an HF checkpoint at `path`, in our names and layouts.

  Raises:
    ValueError: an HF tensor no rule matches (and not a known buffer), a rule with no
      tensor, a layer missing, or a tensor whose shape the model's widths cannot hold.
  """
  hf_config = read_config(path)
  family = families.get(hf_config.get("model_type"))
  fields = family.fields(hf_config)
  mapping = ResolvedRules(family, fields)
  files = SafetensorsFiles(path)
  patterns = [(rule, _pattern(rule.hf, family.prefix)) for rule in mapping.rules]
  ignored = [_pattern(name, family.prefix) for name in family.ignored]
  found: dict[str, dict[tuple[int, ...], str]] = {rule.ours: {} for rule in mapping.rules}
  unmatched = []
  for name in files.names():
    hit = next(((rule, m) for rule, p in patterns if (m := p.fullmatch(name))), None)
    if hit is None:
      if not any(p.fullmatch(name) for p in ignored):
        unmatched.append(name)
      continue
    rule, m = hit
    found[rule.ours][tuple(int(m.group(g)) for g in ("i", "e") if g in m.groupdict())] = name
  where = files.description
  if unmatched:
    raise ValueError(f"config.init_from.path: {len(unmatched)} tensor(s) of {where} match no "
                     f"rule of the {family.model_type!r} mapping: {unmatched[:12]}; this "
                     f"project's {family.model_type} model has no parameter for them.")
  problems, conversions = [], {}
  for rule in mapping.rules:
    layers = found[rule.ours]
    want = mapping.indices(rule)
    missing = [mapping.hf_name(rule, i) for i in want if i not in layers]
    extra = sorted(set(layers) - set(want))
    if missing or extra:
      stacked = (f"num_hidden_layers={mapping.num_layers}"
                 + (f" and {mapping.num_experts} experts" if rule.per_expert else ""))
      problems.append(f"{rule.ours}: " + (f"missing {missing[:4]}" if missing else "") +
                      (f" indices {extra[:4]} beyond {stacked}" if extra else ""))
      continue
    shapes = {files.shape(layers[i]) for i in want}
    if len(shapes) > 1:
      problems.append(f"{rule.ours}: its layers differ in shape {sorted(shapes)}")
      continue
    try:
      conversions[rule.ours] = Conversion(rule, mapping.dims, shapes.pop())
    except ValueError as e:
      problems.append(f"{rule.ours}: {e} (config widths {mapping.dims})")
  if problems:
    raise ValueError(f"config.init_from.path: {where} does not hold the "
                     f"{family.model_type!r} model its {CONFIG} describes:\n  " +
                     "\n  ".join(problems))

  def shape_of(path: str) -> tuple[int, ...]:
    c = conversions[path]
    return mapping.stack(c.rule) + c.shape

  def read_slice(collection: str, path: str, index: Sequence[Any] | None) -> np.ndarray:
    """Our `path[index]`: each (layer[, expert]) tensor in the index read for its slice
    only, so a device reads only its layers' and experts' tensors."""
    del collection
    c = conversions[path]
    stack = mapping.stack(c.rule)
    if not stack:
      return c.read(files, found[path][()], index)
    index = _full(index, shape_of(path))
    outer, rest = index[:len(stack)], index[len(stack):]
    picked = list(itertools.product(*(range(s.start, s.stop) for s in outer)))
    parts = [c.read(files, found[path][i], rest) for i in picked]
    sizes = tuple(s.stop - s.start for s in outer)
    return np.stack(parts).reshape(sizes + parts[0].shape)

  def read(wanted: Mapping[str, list[str]]):
    return {c: {p: read_slice(c, p, None) for p in paths} for c, paths in wanted.items()}

  return Source(f"{where} ({family.model_type})", 0,
                {"params": {p: shape_of(p) for p in conversions}}, read,
                read_slice=read_slice, complete=True, handle=files)


def export(values: Mapping[str, np.ndarray], fields: Mapping[str, Any], out_dir: str, *,
           dtype: str | None = None) -> list[str]:
  """Writes `config.json` and `model.safetensors` of our parameters `values` (`{path:
  array}`, one model) in HF's names and layouts; returns the tensor names written.

  A field of `fields` left None (`configs/lm.py`: the family's default) is written as the
  value the module computed with (`families.module_fields`), never as JSON null.

  Raises:
    ValueError: `fields` name no family with a mapping, a parameter is missing, or a
      parameter is left over (one the family's mapping has no HF tensor for).
  """
  from safetensors.numpy import save_file

  family = families.get(fields["family"], field="config.model.family")
  fields = families.module_fields(**fields)
  mapping = ResolvedRules(family, fields)
  hf_config = family.hf_config(fields)
  tensors, used = {}, set()
  for rule in mapping.rules:
    if rule.ours not in values:
      raise ValueError(f"export: the checkpoint has no parameter {rule.ours!r}, which "
                       f"{family.model_type} needs for {rule.hf}; its parameters are "
                       f"{sorted(values)[:12]}.")
    used.add(rule.ours)
    x = np.asarray(values[rule.ours])
    stack = mapping.stack(rule)
    if rule.vocab is not None:  # A vocabulary padded to the mesh: only the real rows.
      x = np.take(x, np.arange(fields["vocab_size"]), axis=rule.vocab + len(stack))
    one = x.shape[len(stack):]
    # A rule without a split keeps each axis: the HF shape is ours, un-permuted.
    hf_shape = () if rule.split else tuple(
        one[i] for i in np.argsort(rule.perm or range(len(one))))
    conversion = Conversion(rule, mapping.dims, hf_shape)
    if x.shape != stack + conversion.shape:
      raise ValueError(f"export: {rule.ours!r} has shape {x.shape}; the model's widths "
                       f"({mapping.dims}) make it {stack + conversion.shape}.")
    layers = list(x.reshape(-1, *conversion.shape))
    for name, layer in zip(mapping.hf_names(rule, family.prefix), layers, strict=True):
      y = conversion.to_hf(np.asarray(layer))
      tensors[name] = y.astype(dtype) if dtype else y
  left = sorted(set(values) - used)
  if left:
    raise ValueError(f"export: {len(left)} parameter(s) have no {family.model_type} tensor to "
                     f"go to: {left[:12]}.")
  os.makedirs(out_dir, exist_ok=True)
  save_file(tensors, os.path.join(out_dir, WEIGHTS), metadata={"format": "pt"})
  with open(os.path.join(out_dir, CONFIG), "w") as f:
    json.dump(hf_config, f, indent=2)
  return sorted(tensors)
