"""Errors raised while a step is traced, translated into what the user should change."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from typing import Any

import flax.errors

from strategies import BATCH_AXIS


class BatchKeyError(KeyError):
  """A hook read a batch entry that the batch does not have."""

  def __str__(self) -> str:  # KeyError would show the message quoted, as a key.
    return str(self.args[0])


def explaining_errors(fn: Callable, hooks: Any) -> Callable:
  """`fn(state_or_rng, batch)`, where reading an entry the batch lacks names those it has,
  and a missing RNG stream or an unbound axis name says what to change.

  Args:
    hooks: the Trainer whose `rng_streams`, `input_key` and `target_key` the
      messages name.
  """
  name = type(hooks).__name__

  @functools.wraps(fn)
  def wrapped(first, batch):
    try:
      return fn(first, batch)
    except flax.errors.InvalidRngError as e:
      raise ValueError(
          f"{e}. {name}.rng_streams={hooks.rng_streams!r}: add the stream the model asks "
          f"for to rng_streams.") from e
    except NameError as e:
      unbound = re.search(r"unbound axis name: (\w+)", str(e))
      if not unbound or unbound.group(1) == BATCH_AXIS:
        raise
      raise ValueError(
          f"{e}: inside a step the data axis is named strategies.BATCH_AXIS="
          f"{BATCH_AXIS!r} under every strategy; use that name (e.g. "
          f"BatchNorm(axis_name={BATCH_AXIS!r})).") from e
    except KeyError as e:
      key = e.args[0] if e.args else None
      if isinstance(e, BatchKeyError) or not isinstance(batch, Mapping) or key in batch:
        raise
      raise BatchKeyError(
          f"the batch has no entry {key!r}; its entries are {sorted(batch)}. {name} reads "
          f"input_key={hooks.input_key!r} and target_key={hooks.target_key!r}: set them on "
          f"the Trainer subclass to the batch's names, or override the hook that reads "
          f"{key!r}.") from e

  return wrapped
