"""Repeated layers, marked once: a scan over stacked parameters, or a pipeline over stages.

A model wraps its repeated block in a layer stack instead of a Python loop or a
hand-written `nn.scan`:

    # Linen (models/transformer.py):
    x = LayerStack(DecoderBlock, num_layers, dict(num_heads=8, ...), name="blocks")(x)
    # NNX, in __init__ and __call__:
    self.blocks = NnxLayerStack(lambda rngs: Block(..., rngs=rngs), num_layers, rngs=rngs)
    x = self.blocks(x)

The block maps activations to activations of the same structure (`block(x) -> x`).
Its parameters are one tree with a leading `layer` axis (the logical name every
strategy's rule table can map), the same under every strategy, so checkpoints move
between them. Without a pipeline (`strategies.pipeline.current()` is None) the stack
is a scan over that axis; under a strategy with a `stage` mesh axis it runs the
strategy's pipeline (`strategies/pipeline.py`).

What a stack can hold when pipelined: parameters and RNG streams (dropout), nothing
that a layer updates across steps (BatchNorm's statistics, a cache): those are
refused, naming the variable. Every parameter in the stack gets `layer` as the name
of its leading axis (NNX: added here; Linen: from `nn.scan`'s metadata where the block
annotates the parameter; a Linen parameter the block leaves unannotated is stored whole
on every stage, and still pipelined).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from flax.core import FrozenDict

from strategies import pipeline as pipelining
from strategies.pipeline import LAYER, PipelineError


class LayerStack(nn.Module):
  """`length` copies of a Linen block, applied in order; parameters stacked on a `layer` axis.

  Attributes:
    block: the block's class; `block(**kwargs)(x)` returns the next `x`.
    length: how many layers.
    kwargs: the block's fields.
  """

  block: type[nn.Module]
  length: int
  kwargs: Mapping[str, Any] = FrozenDict()

  def _scanned(self, x):
    def body(block, carry, _):
      return block(carry), None

    # Every collection stacked (BatchNorm's statistics too), every RNG stream split per layer.
    scan = nn.scan(body, variable_axes={True: 0}, split_rngs={True: True}, length=self.length,
                   metadata_params={nn.PARTITION_NAME: LAYER})
    block = self.block(**self.kwargs, parent=None)
    block = block.clone(parent=self, name="layer")
    nn.share_scope(self, block)  # Its parameters are the stack's own: no extra level.
    out, _ = scan(block, x, None)
    return out

  @nn.compact
  def __call__(self, x):
    plan = pipelining.current()
    if plan is None or self.is_initializing():
      return self._scanned(x)
    path = "/".join(self.scope.path)
    for collection in self.variables:
      if collection != "params":
        raise PipelineError(
            f"the layer stack {path!r} holds {collection!r} variables (e.g. BatchNorm's "
            f"statistics): a pipelined stack may hold only parameters and RNG streams, since "
            f"each stage sees microbatches, not the batch. Move that layer out of the stack, "
            f"or train without a 'stage' mesh axis.")
    params = self.variables.get("params", {})
    streams = sorted(name for name in self.scope.rngs if name != "params")
    layer_keys = {name: jax.random.split(self.make_rng(name), self.length) for name in streams}
    block = self.block(**self.kwargs, parent=None)

    def layer(p, h, microbatch):
      return block.apply({"params": p["params"]}, h, rngs={
          name: jax.random.fold_in(key, microbatch) for name, key in p["keys"].items()})

    stacked = {"params": nn.meta.unbox(params), "keys": layer_keys}
    return plan.run(layer, stacked, x)


def _name_layer_axis(layers: nnx.Module) -> None:
  """Every parameter of stacked `layers` names its leading axis `layer` (unannotated ones too)."""
  for _, variable in nnx.iter_graph(layers):
    if isinstance(variable, nnx.Param):
      names = variable.get_metadata().get("out_sharding")
      if not names:
        variable.set_metadata(out_sharding=(LAYER,) + (None,) * (variable.ndim - 1))


class NnxLayerStack(nnx.Module):
  """`num_layers` NNX blocks made by `make_layer(rngs)`, stacked on a leading `layer` axis.

  `stack(x)` runs them in order: a scan, or the strategy's pipeline. A block that draws
  randomness (dropout) keeps its own stream per layer; pipelined, microbatch `m` folds `m`
  into each layer's key.
  """

  def __init__(self, make_layer: Callable[[nnx.Rngs], nnx.Module], num_layers: int, *,
               rngs: nnx.Rngs):
    @nnx.split_rngs(splits=num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: LAYER})
    def create(rngs):
      return make_layer(rngs)

    self.layers = create(rngs)
    self.num_layers = num_layers
    _name_layer_axis(self.layers)

  def __call__(self, x):
    graphdef, params, rest = nnx.split(self.layers, nnx.Param, ...)
    plan = pipelining.current()
    if plan is None:
      def body(h, layer_state):
        p, r = layer_state
        module = nnx.merge(graphdef, p, r)
        h = module(h)
        return h, nnx.state(module, nnx.Not(nnx.Param))

      x, rest = jax.lax.scan(body, x, (params, rest))
      nnx.update(self.layers, rest)
      return x
    kept = [str(path) for path, v in nnx.iter_graph(self.layers)
            if isinstance(v, nnx.Variable) and not isinstance(v, nnx.Param | nnx.RngState)]
    if kept:
      raise PipelineError(
          f"the NNX layer stack holds variables a layer updates ({kept[0]}, e.g. BatchNorm's "
          f"statistics): a pipelined stack may hold only parameters and RNG streams, since "
          f"each stage sees microbatches, not the batch. Move that layer out of the stack, or "
          f"train without a 'stage' mesh axis.")

    def layer(p, h, microbatch):
      module = nnx.merge(graphdef, p["params"], jax.tree.map(
          lambda a: _fold_key(a, microbatch), p["rest"]))
      return module(h)

    return plan.run(layer, {"params": params, "rest": rest}, x)


def _fold_key(a: jax.Array, microbatch: jax.Array) -> jax.Array:
  """A typed RNG key with the microbatch folded in; any other array as it is."""
  if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
    return jax.random.fold_in(a, microbatch)
  return a
