"""The reference policy a preference loss compares the policy with: three ways to hold it.

`config.preference.reference`:

- `"copy"`: a frozen copy of the initial weights (after `config.init_from` loads them), a
  field of the train state (`PreferenceTrainState.reference`) laid out by the same rule
  table as the parameters, checkpointed with them. It costs the parameters' bytes again
  on the devices and a forward pass a step.
- `"adapters_off"`: under LoRA or QLoRA, the policy's own weights with every adapter's
  `B` set to zero: the base model, with no second copy. A forward pass a step.
- `"precomputed"`: the reference's log-probs of every pair the run will train on,
  computed in one pass over the run's batches before the first step (the initial policy
  is the reference) and stored in the workdir by step, the data position: a resumed run
  reads them from there. No forward pass of the reference during training; the pairs
  are fixed when the run starts (its `num_train_steps` batches).
- `"auto"`: `adapters_off` under LoRA, else `copy`.

Losses without a reference (SimPO, ORPO) hold none.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from trainer.preference.data import REF_LOGPS
from trainer.step.train_state import EmaTrainState

CHOICES = ("auto", "copy", "adapters_off", "precomputed")
#: The `model_state` entries through which the train and eval steps hand the copy, and a
#: sweep's per-member beta, to the loss.
REFERENCE, BETA = "reference", "preference_beta"
#: Where a run keeps its precomputed reference log-probs.
STORED_FILE = "reference_logps.npz"


class PreferenceTrainState(EmaTrainState):
  """A train state that also holds the reference's weights (`reference="copy"`), and under
  a sweep the loss's beta as an array (each member's own); None (no leaf) otherwise. An
  EMA of the parameters (`config.ema_decay`) is kept beside them."""

  reference: Any = None
  beta: Any = None


def choose(config) -> str:
  """`config.preference.reference` resolved (`"auto"` made concrete; `"none"` for the
  losses that use no reference).

  Raises:
    ValueError: naming the field, the value and what is accepted.
  """
  from trainer.preference.losses import WITH_REFERENCE
  spec = config.preference
  if spec.reference not in CHOICES:
    raise ValueError(f"config.preference.reference={spec.reference!r} is not one of "
                     f"{CHOICES}.")
  if spec.loss not in WITH_REFERENCE:
    return "none"
  choice = resolve(spec.reference, config, field="config.preference.reference",
                   otherwise="'copy' (a frozen copy of the weights) or 'precomputed'")
  if choice == "copy" and config.lora.base_dtype:
    raise ValueError(f"config.preference.reference='copy' with a quantized base "
                     f"(config.lora.base_dtype={config.lora.base_dtype!r}): the base is the "
                     f"reference already; use 'adapters_off' (or 'precomputed').")
  return choice


def resolve(choice: str, config, *, field: str, otherwise: str) -> str:
  """A reference choice made concrete: `"auto"` is `adapters_off` under LoRA, else `copy`.

  Raises:
    ValueError: `adapters_off` without LoRA, naming `field` and `otherwise`, what to use.
  """
  lora = bool(config.lora.rank)
  if choice == "auto":
    return "adapters_off" if lora else "copy"
  if choice == "adapters_off" and not lora:
    raise ValueError(f"{field}='adapters_off' needs LoRA adapters to turn off "
                     f"(config.lora.rank > 0); without LoRA use {otherwise}.")
  return choice


def adapters_off(params: Any) -> Any:
  """The parameters with every LoRA adapter's `B` zero: the base model's products."""
  from strategies.tree import keypath_str
  from trainer.step.lora import SUFFIX_B

  def off(path, x):
    return jnp.zeros_like(x) if keypath_str(path, drop_box=True).endswith(SUFFIX_B) else x
  return jax.tree_util.tree_map_with_path(off, params)


class Stored:
  """Train batches with the reference's log-probs of each pair (`REF_LOGPS`, `[rows, 2]`)
  added from a table by step: `stored(start_step)` is what `fit` takes. The iterator's
  position is its source's (`get_state`/`set_state`), the step the one `fit` starts at.

  Args:
    source: the train batches, `start_step -> iterator`.
    table: `[steps, rows, 2]` log-probs, row `s` of batch `s`.
  """

  def __init__(self, source: Callable[[int], Iterator], table: np.ndarray):
    self.source, self.table = source, table

  def __call__(self, start_step: int = 0) -> _StoredIterator:
    return _StoredIterator(self.source(start_step), self.table, start_step)


class _StoredIterator:

  def __init__(self, inner, table: np.ndarray, step: int):
    self._inner, self._table, self._step = inner, table, step

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    if self._step >= len(self._table):
      raise ValueError(f"step {self._step} has no stored reference log-probs: the table holds "
                       f"{len(self._table)} steps (config.num_train_steps when it was made). "
                       f"Delete {STORED_FILE} from the workdir to compute them for a longer "
                       f"run.")
    batch = dict(next(self._inner))
    batch[REF_LOGPS] = self._table[self._step]
    self._step += 1
    return batch

  def __getattr__(self, name: str):  # get_state, set_state, skipped, close: the source's.
    return getattr(self._inner, name)


def precompute(trainer, state, train_batches: Callable[[int], Iterator], *, num_steps: int,
               workdir: str | None, eval_batches: list | None = None
               ) -> tuple[Stored, list]:
  """The reference log-probs of the run's first `num_steps` batches (and of
  `eval_batches`) under `state`, the policy before its first update: read from `workdir`
  where an earlier start of the run stored them, else computed (one forward pass a
  batch) and stored there (this process's rows, by process index).

  Returns:
    the train batches with the log-probs added (`Stored`), and the eval batches with
    theirs.

  Raises:
    ValueError: a stored table for another batch shape or run length.
  """
  eval_batches = list(eval_batches or [])
  rows = trainer.strategy.process_slice(trainer.config.batch_size)
  start, stop, _ = rows.indices(trainer.config.batch_size)
  path = None
  if workdir:
    path = os.path.join(workdir, f"{jax.process_index()}.{STORED_FILE}" if
                        jax.process_count() > 1 else STORED_FILE)
  if path and os.path.isfile(path):
    with np.load(path) as stored:
      table, held = stored["train"], stored["eval"]
    if (table.shape[1:] != (stop - start, 2) or len(table) < num_steps
        or len(held) != len(eval_batches)):
      raise ValueError(f"{path} holds reference log-probs of {table.shape[0]} steps of "
                       f"{table.shape[1]} rows and {len(held)} eval batches; this run needs "
                       f"{num_steps} steps of {stop - start} rows and {len(eval_batches)} "
                       f"eval batches. Delete it to compute them again.")
    logging.info("Reference log-probs of %d steps read from %s.", len(table), path)
  else:
    logps = trainer.reference_logps_fn(state)

    def of(batch):
      return np.asarray(jax.device_get(logps(state, trainer.strategy.put_batch(batch))))
    batches = iter(train_batches(0))
    table = np.stack([of(next(batches))[start:stop] for _ in range(num_steps)]).astype(
        np.float32)
    close = getattr(batches, "close", None)
    if close is not None:
      close()
    held = np.stack([of(b) for b in eval_batches]).astype(np.float32) if eval_batches else (
        np.zeros((0, 0, 2), np.float32))
    if path:
      os.makedirs(workdir, exist_ok=True)
      tmp = path + ".tmp.npz"
      np.savez(tmp, train=table, eval=held)
      os.replace(tmp, path)
      logging.info("Reference log-probs of %d steps stored in %s.", num_steps, path)
  return Stored(train_batches, table), [
      {**b, REF_LOGPS: held[i]} for i, b in enumerate(eval_batches)]
