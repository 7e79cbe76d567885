"""Where a run's train state comes from: a new one, or a checkpoint.

A new state is the strategy's placed init of the model; with
`config.init_from`, the variables its rules load replace the fresh ones
(checked against the model's shapes before anything is computed); under a
sweep, each member's optimizer then holds its own hyperparameters. A restored
one is read from a checkpoint written under any strategy, into this
strategy's layout, in one call.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections

from strategies import Strategy
from strategies.base import init_compiler_options
from trainer.checkpoint import Checkpointer, RunState, init_from, loading, restore_run
from trainer.run import shared
from trainer.step.functions import StepFunctions
from trainer.step.recipe import Recipe
from trainer.sweep.members import Sweep
from trainer.sweep.optimizer import place_hyperparameters

Batch = Mapping[str, Any]
PyTree = Any


class States:
  """Makes the placed train state of a run: new (`init`) or restored (`restore`).

  Args:
    config: `seed` (the default RNG) and `init_from.*`.
    steps: the step functions, whose `init_fn` builds one model's state.
    strategy: creates and places the state in its layout.
    recipe: adds what the recipe keeps (an EMA) to a state made from loaded variables.
    create_train_state: the Trainer's hook, `(*, params, model_state, rng) -> state`.
    sweep: puts each member's hyperparameters into its optimizer state (None: no sweep).
    linen: whether the model is a Linen module (else NNX): how `init_from` names paths.

  Raises:
    ValueError: `config.init_from.path` does not exist (or holds no checkpoint step).
  """

  def __init__(self, config: ml_collections.ConfigDict, *, steps: StepFunctions,
               strategy: Strategy, recipe: Recipe, create_train_state: Callable[..., Any],
               sweep: Sweep | None, linen: bool):
    self.config, self.steps, self.strategy, self.recipe = config, steps, strategy, recipe
    self.create_train_state, self.sweep, self.linen = create_train_state, sweep, linen
    spec = config.init_from
    #: `config.init_from`'s source, opened (None: off).
    self.source = (init_from.open_source(spec.path, step=spec.step, linen=linen)
                   if spec.path else None)
    if spec.adapters:  # A PEFT adapter's LoRA beside the base.
      from trainer.interop import peft
      self.source = peft.with_adapters(self.source, spec.adapters, config, linen=linen)
    shared.requested(config)  # `config.strategy.share_frozen` checked before compute.
    self._example: Batch | None = None  # The batch the last state was made or restored for.
    self._init_members: Callable[[jax.Array], PyTree] | None = None

  def init(self, example_batch: Batch, rng: jax.Array | None = None) -> PyTree:
    """A new placed state for batches shaped like `example_batch`; `rng` defaults to
    `PRNGKey(config.seed)`."""
    if rng is None:
      rng = jax.random.PRNGKey(self.config.seed)
    self._example = example_batch
    init_fn = self.steps.init_fn(example_batch)
    # The rules are checked before anything is computed.
    abstract = jax.eval_shape(init_fn, rng)
    plan = self._share(abstract)
    state = self.strategy.create_state(init_fn, rng)
    if self.source is not None:
      state = loading.start_from(plan, self.strategy, state, abstract, self._fresh,
                                   linen=self.linen)
    if self.sweep is not None:  # Each member's own hyperparameters into its optimizer.
      state = place_hyperparameters(state, self.sweep)
    return state

  def init_members(self, seeds: list[int]) -> PyTree:
    """A new ensemble state whose member i starts from `PRNGKey(seeds[i])` (as `init`
    would for a sweep with those seeds), on the default device (the caller places it):
    a sweep slot's next configuration.

    Raises:
      ValueError: no state was made or restored yet (the batch shapes are unknown).
    """
    if self._example is None:
      raise ValueError("States.init_members needs the batch shapes of a state made or "
                       "restored before (init or restore).")
    if self.source is not None or getattr(self.strategy, "shared", None) is not None:
      # `init_from` starts each member from loaded variables; the parts held once stay one.
      saved, self.strategy.member_seeds = self.strategy.member_seeds, list(seeds)
      try:
        return self.init(self._example)
      finally:
        self.strategy.member_seeds = saved
    if self._init_members is None:  # Compiled once: a refill costs an init, not a compile.
      self._init_members = jax.jit(jax.vmap(self.steps.init_fn(self._example)),
                                   compiler_options=init_compiler_options(jax.devices()[:1]))
    return self._init_members(jnp.stack([jax.random.PRNGKey(s) for s in seeds]))

  def _fresh(self, params: PyTree, model_state: PyTree, rng: jax.Array) -> PyTree:
    """A new state of one model from its variables and RNG (optimizer, recipe: fresh)."""
    return self.recipe.init_state(self.create_train_state(
        params=params, model_state=model_state, rng=rng))

  def abstract(self, example_batch: Batch) -> PyTree:
    """One model's state as shapes and dtypes, for batches shaped like `example_batch`
    (the strategy told which of its frozen parts are held once, `trainer.run.shared`)."""
    abstract = jax.eval_shape(self.steps.init_fn(example_batch), jax.random.PRNGKey(0))
    self._share(abstract)
    return abstract

  def _share(self, abstract: PyTree) -> init_from.Plan | None:
    """`config.init_from`'s plan for `abstract` (None: off), after telling an ensemble
    strategy that can share which leaves it holds once.

    Raises:
      ValueError: `init_from`'s rules, or a part `config.strategy.share_frozen` names that
        is not the same in every member.
    """
    plan = None
    if self.source is not None:
      plan = init_from.plan(
          self.config, self.source,
          init_from.variables_by_collection(abstract.params, abstract.model_state,
                                            linen=self.linen),
          num_members=self.strategy.checkpoint_layout()["num_members"],
          vocab=init_from.vocab_axes(abstract.params))
    if hasattr(self.strategy, "share"):
      self.strategy.share(shared.sharing(self.config, abstract, plan))
    return plan

  def restore(self, checkpointer: Checkpointer, example_batch: Batch, *,
              step: int | None = None, member: int | None = None) -> RunState:
    """The run saved at `step` (None: the latest), written under any strategy, in this
    strategy's layout (`trainer.checkpoint.restore_run`); `member`: one member of a
    saved ensemble, for a single-model strategy."""
    self._example = example_batch
    return restore_run(checkpointer, self.strategy, self.abstract(example_batch), step=step,
                       member=member)
