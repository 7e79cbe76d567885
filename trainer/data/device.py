"""A dataset split that lives on the devices (`config.data.pipeline = "device"`).

For datasets that fit in device memory (MNIST's 47 MB of uint8 train images
easily), the host's per-step work (read, check, copy a batch) can go away:
the split is placed once, whole, on every device of the strategy, and each
train step gathers its batch inside the compiled call. With several steps per
call (`config.steps_per_call`) the host only dispatches one call per chunk.

The order is the one `trainer.data.train_batches` uses, with the permutation
computed on the device: batch s is rows `i * batch_size ... (i + 1) *
batch_size` of `permutation(epoch)` for `epoch, i = divmod(s, steps_per_epoch)`
(the short end of an epoch is dropped). It is a pure function of (seed, step),
so a resumed run needs no data position (the step is the position), and the
batches are the same under every strategy and process count: each step
gathers the global batch's row indices, then keeps the rows it sees
(`Strategy.replica_rows`).

The split is replicated, not sharded over the data axis: every device can
then gather any row, so the batch composition does not depend on the device
count and no step moves examples between devices.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any
Batch = Mapping[str, Any]


#: uint8 value -> float32 in [0, 1], divided on the host: inside a compiled step XLA
#: turns `x / 255` into `x * (1 / 255)`, which rounds differently in some values.
_UNIT_FLOAT = np.arange(256, dtype=np.float32) / 255.0


def as_float_images(arrays: Batch) -> dict[str, jax.Array]:
  """MNIST-style rows to a batch: uint8 `image` scaled to [0, 1] float32, int32 `label`.

  The same bits as `Split.batch` gives on the host (a table look-up, not a division).
  """
  return {"image": jnp.asarray(_UNIT_FLOAT)[arrays["image"]], "label": arrays["label"]}


class DeviceData:
  """A train split to place on the devices, and how each step's batch is cut from it.

  Pass it to `Trainer.fit` in place of host batches.

  Args:
    arrays: `{name: host array [num_examples, ...]}`, the raw split (e.g. uint8 images).
    batch_size: the global batch size.
    seed: the data order's seed: epoch e's order is `permutation(e)`.
    transform: `gathered rows -> batch`, traced into the step (jnp), e.g.
      `as_float_images`; None passes the rows through.

  Raises:
    ValueError: the arrays disagree on the number of examples, or hold fewer
      than one batch.
  """

  def __init__(self, arrays: Batch, *, batch_size: int, seed: int,
               transform: Callable[[Batch], Batch] | None = None):
    sizes = {name: np.shape(x)[0] for name, x in arrays.items()}
    if len(set(sizes.values())) != 1:
      raise ValueError(f"DeviceData arrays hold different numbers of examples: {sizes}.")
    self.arrays = dict(arrays)
    self.num_examples = next(iter(sizes.values()))
    self.batch_size, self.seed = batch_size, seed
    self.transform = transform or (lambda rows: dict(rows))
    self.steps_per_epoch = self.num_examples // batch_size
    self._orders_fn = None
    self._placed: tuple[Any, PyTree] | None = None
    if self.steps_per_epoch == 0:
      raise ValueError(f"config.batch_size={batch_size} exceeds the {self.num_examples} "
                       f"training examples.")

  @property
  def nbytes(self) -> int:
    """Bytes one copy of the split takes on a device."""
    return int(sum(np.asarray(x).nbytes for x in self.arrays.values()))

  def placed(self, strategy: Any) -> PyTree:
    """The arrays on every device of `strategy` (`put_replicated`), placed once per strategy."""
    if self._placed is None or self._placed[0] is not strategy:
      self._placed = None  # The previous copy goes before the next one comes.
      self._placed = (strategy, strategy.put_replicated(
          {name: np.asarray(x) for name, x in self.arrays.items()}))
    return self._placed[1]

  def permutation(self, epoch: int | jax.Array) -> jax.Array:
    """Epoch `epoch`'s order of the examples (on the default device; jit-able)."""
    key = jax.random.fold_in(jax.random.key(self.seed), epoch)
    return jax.random.permutation(key, self.num_examples)

  def epochs_per_call(self, steps_per_call: int) -> int:
    """How many epochs' orders a call of up to `steps_per_call` steps may need."""
    return (steps_per_call - 1) // self.steps_per_epoch + 2

  def orders(self, first_epoch: int, count: int) -> np.ndarray:
    """The orders of epochs `first_epoch .. first_epoch + count - 1`, stacked (host)."""
    if self._orders_fn is None:
      self._orders_fn = jax.jit(jax.vmap(self.permutation))
    return np.asarray(self._orders_fn(jnp.arange(first_epoch, first_epoch + count)))

  def example_batch(self, rows: slice = slice(None)) -> dict[str, np.ndarray]:
    """The first batch's `rows` on the host: the shapes the steps are compiled for."""
    first = np.asarray(self.permutation(0))[:self.batch_size][rows]
    return jax.tree.map(np.asarray, self.transform(
        {name: jnp.asarray(np.asarray(x)[first]) for name, x in self.arrays.items()}))

  def batch_at(self, inputs: PyTree, step: jax.Array, strategy: Any) -> Batch:
    """Inside a compiled step: the batch of `step`, as the strategy's step sees it.

    Args:
      inputs: `(arrays, orders, first_epoch)` as placed by `DeviceSource`.
      step: the step's number (`state.step`).
      strategy: keeps the rows this step sees (`replica_rows`) and lays the
        batch out (`constrain_batch`).
    """
    arrays, orders, first_epoch = inputs
    epoch, index = jnp.divmod(step, self.steps_per_epoch)
    order = orders[epoch - first_epoch]
    rows = jax.lax.dynamic_slice_in_dim(order, index * self.batch_size, self.batch_size)
    rows = strategy.constrain_batch(strategy.replica_rows(rows))
    gathered = {name: jnp.take(x, rows, axis=0) for name, x in arrays.items()}
    return strategy.constrain_batch(self.transform(gathered))


class DeviceSource:
  """The placed split and the epoch orders a call needs, kept on the devices.

  The split goes to the devices once; the orders (one int32 per example per
  epoch) are computed on the device and placed again only when a call starts
  in a new epoch.

  Args:
    data: the split.
    strategy: places the arrays (`put_replicated`).
    steps_per_call: the longest call, which fixes how many epochs' orders a call gets.
  """

  def __init__(self, data: DeviceData, strategy: Any, steps_per_call: int):
    self.data, self.strategy = data, strategy
    self.count = data.epochs_per_call(steps_per_call)
    self.arrays = data.placed(strategy)
    self._first_epoch: int | None = None
    self._orders = None

  def inputs(self, step: int) -> tuple[PyTree, jax.Array, jax.Array]:
    """What a call starting at `step` passes as its `data`."""
    epoch = step // self.data.steps_per_epoch
    if epoch != self._first_epoch:
      self._orders = self.strategy.put_replicated(
          (self.data.orders(epoch, self.count), np.int32(epoch)))
      self._first_epoch = epoch
    orders, first_epoch = self._orders
    return self.arrays, orders, first_epoch
