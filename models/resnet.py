"""A small ResNet with BatchNorm, written the way the Flax ImageNet example writes it.

BatchNorm takes `use_running_average=not train` and `axis_name="batch"`: every
strategy binds that axis name inside a step, so the statistics are over the
global batch under data parallelism (and per member in ensembles).
"""

import functools
from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp


class ResNetBlock(nn.Module):
  """conv-BN-relu-conv-BN plus a (projected) shortcut, then relu."""

  filters: int
  strides: tuple[int, int] = (1, 1)

  @nn.compact
  def __call__(self, x: jax.Array, train: bool) -> jax.Array:
    norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9,
                             epsilon=1e-5, axis_name="batch")
    y = nn.Conv(self.filters, (3, 3), self.strides, use_bias=False)(x)
    y = nn.relu(norm()(y))
    y = nn.Conv(self.filters, (3, 3), use_bias=False)(y)
    y = norm(scale_init=nn.initializers.zeros)(y)  # Each block starts as the identity.
    if x.shape != y.shape:
      x = norm()(nn.Conv(self.filters, (1, 1), self.strides, use_bias=False)(x))
    return nn.relu(x + y)


class ResNet(nn.Module):
  """3x3 stem, then stages of `ResNetBlock` modules (stride 2 between stages), mean-pool, dense.

  Attributes:
    stage_sizes: blocks per stage; stage i has `num_filters * 2**i` channels.
    num_filters: channels of the stem and the first stage.
    num_classes: size of the output logits.
  """

  stage_sizes: Sequence[int] = (1, 1, 1)
  num_filters: int = 16
  num_classes: int = 10

  @nn.compact
  def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
    x = nn.Conv(self.num_filters, (3, 3), use_bias=False, name="stem")(x)
    x = nn.BatchNorm(use_running_average=not train, momentum=0.9, epsilon=1e-5,
                     axis_name="batch", name="stem_norm")(x)
    x = nn.relu(x)
    for i, blocks in enumerate(self.stage_sizes):
      for j in range(blocks):
        strides = (2, 2) if i > 0 and j == 0 else (1, 1)
        x = ResNetBlock(self.num_filters * 2**i, strides)(x, train)
    x = jnp.mean(x, axis=(1, 2))
    return nn.Dense(self.num_classes)(x)
