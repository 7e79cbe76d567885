"""Pytree helpers the strategies share: key paths, abstract targets, host views, member merges."""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np

PyTree = Any


def key_name(key: Any) -> str:
  """The name of one entry of a jax key path (a dict key, an attribute, an index)."""
  return str(getattr(key, "key", getattr(key, "name", getattr(key, "idx", key))))


def keypath_str(path: tuple, *, drop_box: bool = False) -> str:
  """`params/layers/W1` for a jax key path; `drop_box` leaves out Flax's `value` box field."""
  names = [key_name(k) for k in path]
  if drop_box and names and names[-1] == "value" and isinstance(path[-1],
                                                                jax.tree_util.GetAttrKey):
    names = names[:-1]
  return "/".join(names)


def is_4bit(dtype: Any) -> bool:
  """Whether `dtype` is a 4-bit integer (`uint4`, `int4`: a QLoRA base's codes)."""
  return np.dtype(dtype).name in ("uint4", "int4")


def array_bytes(shape: Any, dtype: Any) -> int:
  """Bytes of an array as XLA's compiled programs hold it: 4-bit values (`uint4`, `int4`: a
  QLoRA base's codes) at half a byte. (XLA:CPU's buffers between calls hold a byte each.)"""
  bits = 4 if is_4bit(dtype) else 8 * np.dtype(dtype).itemsize
  return -(-int(np.prod(tuple(shape), dtype=np.int64)) * bits // 8)


def abstract_with_sharding(abstract: PyTree, sharding: jax.sharding.Sharding,
                           leading: tuple[int, ...] = ()) -> PyTree:
  """A `ShapeDtypeStruct` for each of `abstract`'s leaves: `leading` axes prepended, on
  `sharding`."""
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(leading + tuple(x.shape), x.dtype, sharding=sharding),
      abstract)


def merge_along_leading_axis(collection: PyTree) -> PyTree:
  """Merges a host clu `Collection` over the leading axis of its arrays (members), in numpy.

  The result is what `Collection.reduce()` gives (each metric's own
  `_reduce_merge`, so `LastValue` averages), but clu runs a `lax.scan` per
  metric for it, about 0.1 s on host arrays; here each merge is a few numpy
  additions.
  """

  def merge(metric):
    parts = [jax.tree.map(lambda x, i=i: x[i], metric)
             for i in range(np.shape(jax.tree.leaves(metric)[0])[0])]
    return functools.reduce(lambda a, b: a._reduce_merge(b), parts)

  return type(collection)(**{name: merge(m) for name, m in vars(collection).items()})


def split_steps(tree: PyTree, axis: int) -> list[PyTree]:
  """A host tree whose arrays hold several steps along `axis`, as one tree per step."""
  num_steps = np.shape(jax.tree.leaves(tree)[0])[axis]
  return [jax.tree.map(lambda x, i=i: np.take(x, i, axis=axis), tree) for i in range(num_steps)]


def first_along_leading_axis(tree: PyTree) -> PyTree:
  """Host copy of element 0 of every leaf's leading axis."""
  return jax.tree.map(lambda x: np.asarray(x[0]), to_host(tree))


def to_host(tree: PyTree) -> PyTree:
  """Host copies of a pytree's arrays, whole, in every process.

  An array sharded over devices of several processes is gathered from all of
  them (`process_allgather`, a collective: every process must call this at the
  same point); replicated and process-local arrays are read where they are.
  """
  def spans_processes(x):
    return (isinstance(x, jax.Array) and not x.is_fully_addressable
            and not x.is_fully_replicated)

  if not any(spans_processes(x) for x in jax.tree.leaves(tree)):
    return jax.device_get(tree)
  from jax.experimental import multihost_utils
  return jax.tree.map(lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True))
                      if spans_processes(x) else jax.device_get(x), tree)
