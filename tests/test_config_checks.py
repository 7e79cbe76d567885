"""Every config field is checked before any part is built (`trainer.config.check_config`):
a bad value is refused naming the field, and no strategy, step or device is touched."""

import pytest
from conftest import CNNTrainer, cnn_config

import strategies
from trainer.config import check_config


@pytest.mark.parametrize("field,value,message", [
    ("steps_per_call", 0, r"config.steps_per_call=0 must be an integer >= 1"),
    ("prefetch_to_device", -1, r"config.prefetch_to_device=-1 must be an integer >= 0"),
    ("watchdog_slow_seconds", -2.0, r"config.watchdog_slow_seconds=-2.0 must be a number"),
    ("steps_loop", "while", r"config.steps_loop='while' is not one of \('scan', 'unroll'\)"),
    ("optimizer", "lamb", r"config.optimizer='lamb' is not supported"),
    ("schedule.warmup_steps", -1, r"config.schedule.warmup_steps=-1 must be an integer >= 0"),
    ("mixed_precision.compute_dtype", "fp8", r"config.mixed_precision.compute_dtype='fp8'"),
    ("grad_accum_loop", "map", r"config.grad_accum_loop='map' is not one of"),
    ("ema_decay", 1.5, r"config.ema_decay=1.5 must be in \[0, 1\)"),
    ("spikes.factor", 0.5, r"config.spikes.factor=0.5 must be a number > 1"),
    ("spikes.warmup", 500, r"config.spikes.warmup=500 must be an integer in \[1, "),
    ("remat.policy", "everything", r"config.remat.policy='everything' is not one of"),
    ("checkpoint.keep_best", 0, r"config.checkpoint.keep_best=0 must be an integer >= 1"),
    ("early_stopping.mode", "up", r"config.early_stopping.mode='up' must be 'min' or 'max'"),
    ("profile.first_step", -1, r"config.profile.first_step=-1 must be an integer >= 0"),
    ("writers", ("jsonl", "csv"), r"config.writers=\('jsonl', 'csv'\) names \['csv'\]"),
    ("sweep.mode", "best", r"config.sweep.mode='best' must be 'min' or 'max'"),
    ("eval_batch_size", 0, r"config.eval_batch_size=0 must be a positive integer"),
])
def test_a_bad_field_is_refused_before_any_part_is_built(field, value, message, monkeypatch):
  overrides = {field: value}
  if field == "early_stopping.mode":
    overrides.update({"early_stopping.metric": "nll", "eval_every_steps": 5})
  if field == "profile.first_step":
    overrides["profile.num_steps"] = 2
  config = cnn_config(**overrides)
  with pytest.raises(ValueError, match=message):
    check_config(config)

  def no_strategy(*args, **kwargs):
    raise AssertionError("a strategy was built before the config was checked")

  monkeypatch.setattr(strategies, "create_strategy", no_strategy)
  with pytest.raises(ValueError, match=message):
    CNNTrainer(config)


def test_a_good_config_passes_and_a_decaying_schedule_needs_no_length_to_be_checked():
  check_config(cnn_config())
  check_config(cnn_config(**{"schedule.name": "cosine", "num_train_steps": 0}))
