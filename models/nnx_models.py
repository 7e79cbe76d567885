"""Flax NNX versions of the MNIST CNN and of the logical-axis MLP.

The Trainer builds an NNX model from its factory (the class, or a
`functools.partial` of it) with `rngs=nnx.Rngs(...)`. Weights carry logical
names through `nnx.with_partitioning`; the sharded strategies map them to mesh
axes with the same rule table as the Linen modules.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx


class CNN(nnx.Module):
  """The NNX form of `models.CNN`: conv 32, avg-pool, conv 64, avg-pool, dense 256, dense."""

  def __init__(self, num_classes: int = 10, *, rngs: nnx.Rngs):
    self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), rngs=rngs)
    self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
    self.dense1 = nnx.Linear(7 * 7 * 64, 256, rngs=rngs)
    self.dense2 = nnx.Linear(256, num_classes, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    pool = lambda y: nnx.avg_pool(y, window_shape=(2, 2), strides=(2, 2))  # noqa: E731
    x = pool(nnx.relu(self.conv1(x)))
    x = pool(nnx.relu(self.conv2(x)))
    x = x.reshape((x.shape[0], -1))
    return self.dense2(nnx.relu(self.dense1(x)))


class MLP(nnx.Module):
  """`num_layers` dot-relu-dot layers with stacked weights, run by `lax.scan`.

  The weights are `W1: (layer, embed, hidden)` and `W2: (layer, hidden, embed)`,
  annotated with those logical names: the stacked layout of the Linen
  `models.MLP` (`nn.scan` with a `layer` axis), so the Flax guide's rule table
  `(('batch', 'data'), ('hidden', 'model'))` gives `W1: P(None, None, 'model')`.
  """

  def __init__(self, embed: int, depth: int = 64, num_layers: int = 4, *, rngs: nnx.Rngs):
    init = nnx.initializers.variance_scaling(1.0, "fan_avg", "normal", batch_axis=(0,))
    self.W1 = nnx.Param(nnx.with_partitioning(init, ("layer", "embed", "hidden"))(
        rngs.params(), (num_layers, embed, depth)))
    self.W2 = nnx.Param(nnx.with_partitioning(init, ("layer", "hidden", "embed"))(
        rngs.params(), (num_layers, depth, embed)))

  def __call__(self, x: jax.Array) -> jax.Array:
    def layer(x, weights):
      w1, w2 = weights
      y = nn.with_logical_constraint(nnx.relu(x @ w1), ("batch", "hidden"))
      return nn.with_logical_constraint(y @ w2, ("batch", "embed")), None

    x, _ = jax.lax.scan(layer, x, (self.W1[...], self.W2[...]))
    return x


def mean_squared_error(outputs: jax.Array, targets: jax.Array) -> jax.Array:
  """Per-example mean squared error."""
  return jnp.mean((outputs - targets) ** 2, axis=-1)
