"""Each step function is traced once for a whole run, evaluation included."""

import pytest
from conftest import CNNTrainer, MLPTrainer, cnn_config, image_batches, mlp_config, vector_batches

STEPS = 12


def _counting(base):
  class Counting(base):
    traces = None

    def train_step(self, state, batch):
      self.traces["train"] += 1
      return super().train_step(state, batch)

    def eval_step(self, state, batch):
      self.traces["eval"] += 1
      return super().eval_step(state, batch)

    def predict_step(self, state, batch):
      self.traces["predict"] += 1
      return super().predict_step(state, batch)

  return Counting


@pytest.mark.parametrize("strategy", ["single_device", "pmap_data_parallel", "pmap_ensemble",
                                      "sharded_data_parallel", "sharded_ensemble"])
def test_cnn_steps_trace_once(strategy):
  trainer = _counting(CNNTrainer)(cnn_config(**{
      "strategy.name": strategy, "ensemble_size": 8, "eval_every_steps": 4,
      "log_every_steps": 5}))
  trainer.traces = {"train": 0, "eval": 0, "predict": 0}
  batches = image_batches(STEPS, 16)
  # Three eval rounds of 5 batches each; the last batch is short and gets padded.
  eval_set = batches[:4] + [{k: v[:5] for k, v in batches[4].items()}]
  state = trainer.fit(batches, num_steps=STEPS, eval_batches=lambda: eval_set).state
  assert trainer.strategy.to_canonical(state.step).max() == STEPS
  # fit traced predict before training; predicting any batch size reuses that trace.
  assert trainer.traces == {"train": 1, "eval": 1, "predict": 1}
  assert trainer.predict(state, eval_set[4]).shape == (5, 10)
  assert trainer.predict(state, batches[0]).shape == (16, 10)
  assert trainer.traces == {"train": 1, "eval": 1, "predict": 1}


def test_sharded_mlp_step_traces_once():
  trainer = _counting(MLPTrainer)(mlp_config(eval_every_steps=6))
  trainer.traces = {"train": 0, "eval": 0, "predict": 0}
  batches = vector_batches(STEPS, 16, 8)
  trainer.fit(batches, num_steps=STEPS, eval_batches=lambda: batches[:3])
  assert trainer.traces == {"train": 1, "eval": 1, "predict": 1}


def test_a_run_that_never_evaluates_traces_its_eval_and_predict_steps_but_lowers_neither():
  """fit traces the eval and predict steps before training, so their errors show first, but
  lowers (jaxpr to MLIR) only what runs: jit keeps the trace, and lowers at a first call."""
  import jax

  lowered = []

  def listener(event, seconds, **kwargs):
    del seconds
    if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
      lowered.append(kwargs.get("fun_name", ""))

  trainer = _counting(MLPTrainer)(mlp_config(eval_every_steps=0))
  trainer.traces = {"train": 0, "eval": 0, "predict": 0}
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    trainer.fit(vector_batches(2, 16, 8), num_steps=2)
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  assert trainer.traces == {"train": 1, "eval": 1, "predict": 1}
  assert any("train_step" in name for name in lowered), lowered
  assert not [name for name in lowered if "eval_step" in name or "predict_step" in name], lowered
