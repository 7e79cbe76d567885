"""Sweeps as ensembles: each member of an ensemble strategy trains with its own optimizer
hyperparameters and seed, in one compiled program (`config.sweep`).

A sweep is a list of members, each a point of hyperparameters and a seed:
`sweep.grid` (name -> values: their product) or `sweep.points` (one dict per
point), times `sweep.seeds`. Member i starts from `PRNGKey(seed_i)`, so it is
the single-model run with its hyperparameters and that seed.

- `members`: `Sweep` (the members, their labels and single-model configs) and
  `SWEPT`, the names a sweep can vary: `learning_rate`, `weight_decay`,
  `momentum` (sgd), `b1` (adam, adamw), `grad_clip_norm`, `warmup_steps`
  (`schedule.warmup_steps`), and `ema_decay` (then kept in the state,
  `EmaTrainState.ema_decay`; every swept value must be > 0, so that each
  member's single-model run has an EMA too);
- `optimizer`: the config's chain with every member's hyperparameters in its
  state (`swept_optimizer`, `place_hyperparameters`);
- `schedulers`: sweeps that choose (`config.sweep.scheduler`): successive
  halving with slot reuse (`Halving`) and population-based training
  (`PopulationBased`), decided from each evaluation; `study`: an Optuna study
  as the source of configurations (`config.sweep.study`: `StudyScheduler`, its
  slots the study's concurrent trials, asked, pruned and refilled in the one
  program); `select`: their decisions
  applied to the stacked state (`Selection`); `lr_find`: a learning-rate range
  test (`config.sweep.lr_find`: `LrFind`, `suggest`, `lr_find_config`);
- `report`: what a sweep reports and leaves behind (`SweepReport`, `summarize`,
  `export_member`, `plot`, `plot_curves`), and `actions`, the sweep's actions
  for a run.

The names below are imported on first use, so that `members` (no jax) can be
read while an entry point parses its flags.
"""

from trainer import _lazy

_EXPORTS = {
    "FINISHED": "trainer.sweep.report",
    "Halving": "trainer.sweep.schedulers",
    "INJECTED": "trainer.sweep.optimizer",
    "LrFind": "trainer.sweep.lr_find",
    "NOT_SWEPT": "trainer.sweep.members",
    "SWEPT": "trainer.sweep.members",
    "PopulationBased": "trainer.sweep.schedulers",
    "SCHEDULERS": "trainer.sweep.schedulers",
    "Scheduler": "trainer.sweep.schedulers",
    "Selection": "trainer.sweep.select",
    "StudyScheduler": "trainer.sweep.study",
    "StudySweep": "trainer.sweep.members",
    "Sweep": "trainer.sweep.members",
    "SweepReport": "trainer.sweep.report",
    "actions": "trainer.sweep.report",
    "export_member": "trainer.sweep.report",
    "fit_strategy": "trainer.sweep.members",
    "format_table": "trainer.sweep.report",
    "lr_find_config": "trainer.sweep.lr_find",
    "place_hyperparameters": "trainer.sweep.optimizer",
    "place_rows": "trainer.sweep.optimizer",
    "plot": "trainer.sweep.report",
    "plot_curves": "trainer.sweep.report",
    "program_steps": "trainer.sweep.schedulers",
    "schedule_value": "trainer.sweep.optimizer",
    "single_model_opt_state": "trainer.sweep.optimizer",
    "strategy_for": "trainer.sweep.members",
    "summarize": "trainer.sweep.report",
    "suggest": "trainer.sweep.lr_find",
    "summary_rows": "trainer.sweep.report",
    "swept_optimizer": "trainer.sweep.optimizer",
}

#: Names that moved when this module became a package, and where they are now.
_MOVED = {"check_sweep_fits": "use trainer.sweep.fit_strategy (it also gives a strategy "
                              "built in code the sweep's seeds)"}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = _lazy.exports(__name__, _EXPORTS, _MOVED)
