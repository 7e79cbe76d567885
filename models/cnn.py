"""The convolutional classifier of the Flax MNIST example."""

import flax.linen as nn
import jax


class CNN(nn.Module):
  """conv 32 -> avg-pool -> conv 64 -> avg-pool -> dense 256 -> dense `num_classes`.

  Attributes:
    num_classes: size of the output logits.
  """

  num_classes: int = 10

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    x = nn.relu(nn.Conv(features=32, kernel_size=(3, 3))(x))
    x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
    x = nn.relu(nn.Conv(features=64, kernel_size=(3, 3))(x))
    x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
    x = x.reshape((x.shape[0], -1))
    x = nn.relu(nn.Dense(features=256)(x))
    return nn.Dense(features=self.num_classes)(x)
