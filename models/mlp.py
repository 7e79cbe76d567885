"""A stack of dot-relu-dot layers annotated with logical axes.

This is the model of Flax's "Scale up Flax Modules on multiple devices" guide:
weights carry logical names (`embed`, `hidden`, and `layer` from `nn.scan`),
activations carry `batch`-first constraints. A rule table maps the names to
mesh axes; without a mesh and rules the annotations are no-ops, so the same
module runs on one device and under pmap.
"""

from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp


class DotReluDot(nn.Module):
  """x @ W1 -> relu -> @ W2, with the hidden width sharded by its logical name.

  Returns a `(output, None)` pair so that the layer can be the body of `nn.scan`.
  """

  depth: int
  dense_init: Callable = nn.initializers.xavier_normal()

  @nn.compact
  def __call__(self, x: jax.Array, _=None) -> tuple[jax.Array, None]:
    embed = x.shape[-1]
    w1 = self.param(
        "W1", nn.with_logical_partitioning(self.dense_init, ("embed", "hidden")),
        (embed, self.depth))
    y = nn.relu(jnp.dot(x, w1))
    y = nn.with_logical_constraint(y, ("batch", "hidden"))
    w2 = self.param(
        "W2", nn.with_logical_partitioning(self.dense_init, ("hidden", "embed")),
        (self.depth, embed))
    z = jnp.dot(y, w2)
    z = nn.with_logical_constraint(z, ("batch", "embed"))
    return z, None


class MLP(nn.Module):
  """`num_layers` DotReluDot layers stacked with `nn.scan` on a `layer` axis.

  Attributes:
    num_layers: how many layers the scan stacks.
    depth: hidden width of each layer (the dimension named `hidden`).
  """

  num_layers: int = 4
  depth: int = 64

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    stack = nn.scan(
        DotReluDot,
        length=self.num_layers,
        variable_axes={"params": 0},
        split_rngs={"params": True},
        metadata_params={nn.PARTITION_NAME: "layer"},
    )
    x, _ = stack(self.depth, name="layers")(x, None)
    return x
