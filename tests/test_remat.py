"""Rematerialisation (`config.remat`): the same training with activations recomputed.

Per-block remat of the Transformer LM (inside `nn.scan`), of an NNX model's
blocks and of a whole Flax-examples-style forward pass (BatchNorm, dropout)
gives the parameters of a run without it, to round-off; the compiled step
holds the checkpointed calls (a `remat` per block in the jaxpr); bad settings
are refused naming the field.
"""

import itertools

import jax
import numerics
import numpy as np
import pytest
import user_models
from conftest import ALL_STRATEGIES, image_batches
from conftest import cnn_config as _cnn_config
from small_configs import tiny_lm_config

from trainer.language_model import LanguageModelTrainer, synthetic_token_batches

STEPS = 3


def _lm_batches(config, num=STEPS):
  return list(itertools.islice(synthetic_token_batches(
      config.seed, config.batch_size, config.seq_len, config.model.vocab_size), num))


def _fit(trainer_cls, config, batches):
  trainer = trainer_cls(config)
  state = trainer.fit(batches, num_steps=len(batches)).state
  return trainer, jax.tree.leaves(trainer.strategy.to_canonical(state.params))


def _assert_close(got, want):
  for a, b in zip(got, want, strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _remats_in_train_step(trainer, batch):
  state = trainer.init_state(batch)
  jaxpr = jax.make_jaxpr(trainer.steps.train)(jax.device_get(
      trainer.strategy.to_canonical(state)), batch)
  return str(jaxpr).count("remat")


@pytest.mark.parametrize("policy", ["nothing_saveable", "dots_saveable"])
def test_the_lm_with_its_blocks_rematerialised_trains_the_same(policy):
  base = tiny_lm_config(**{"strategy.name": "single_device"})
  batches = _lm_batches(base)
  _, want = _fit(LanguageModelTrainer, base, batches)
  config = tiny_lm_config(**{"strategy.name": "single_device", "remat.policy": policy,
                             "remat.modules": ("DecoderBlock",)})
  trainer, got = _fit(LanguageModelTrainer, config, batches)
  _assert_close(got, want)
  assert _remats_in_train_step(trainer, batches[0]) >= 1  # The block inside nn.scan.
  assert _remats_in_train_step(LanguageModelTrainer(base), batches[0]) == 0


def test_the_lm_under_fsdp_with_remat_trains_like_a_single_device():
  single = tiny_lm_config(**{"strategy.name": "single_device"})
  batches = _lm_batches(single)
  reference, want = _fit(LanguageModelTrainer, single, batches)
  chaos = numerics.chaos_fits(reference, batches, num_steps=len(batches), view=lambda state:
                              jax.tree.leaves(reference.strategy.to_canonical(state.params)))
  config = tiny_lm_config("fsdp", **{"remat.policy": "nothing_saveable",
                                     "remat.modules": ("DecoderBlock",)})
  _, got = _fit(LanguageModelTrainer, config, batches)
  numerics.assert_equivalent(got, want, chaos)  # As the layouts' own test.


@pytest.mark.parametrize("strategy", ["single_device", "pmap_data_parallel", "sharded_ensemble"])
def test_a_flax_style_model_rematerialised_whole_trains_the_same(strategy):
  """BatchNorm over `batch` and dropout by `train`: statistics and masks are unchanged."""
  batches = image_batches(STEPS, 16)
  overrides = ALL_STRATEGIES[strategy]
  _, want = _fit(user_models.FlaxStyleTrainer, _cnn_config(**overrides), batches)
  trainer, got = _fit(user_models.FlaxStyleTrainer,
                      _cnn_config(**overrides, **{"remat.policy": "nothing_saveable"}), batches)
  _assert_close(got, want)
  if strategy == "single_device":
    assert _remats_in_train_step(trainer, batches[0]) == 1


@pytest.mark.parametrize("modules", [(), ("Linear",)])
def test_an_nnx_model_with_batchnorm_rematerialised_trains_the_same(modules):
  batches = image_batches(STEPS, 16)
  _, want = _fit(user_models.NnxBatchNormTrainer, _cnn_config(dropout_rate=0.2), batches)
  trainer, got = _fit(user_models.NnxBatchNormTrainer, _cnn_config(
      dropout_rate=0.2, **{"remat.policy": "nothing_saveable", "remat.modules": modules}),
      batches)
  _assert_close(got, want)
  assert _remats_in_train_step(trainer, batches[0]) == (2 if modules else 1)  # Two Linears.


@pytest.mark.parametrize("overrides,message", [
    ({"remat.policy": "save_everything"},
     r"config.remat.policy='save_everything' is not one of \('nothing_saveable', "),
    ({"remat.modules": ("DecoderBlock",)},
     r"config.remat.modules=\('DecoderBlock',\) needs config.remat.policy"),
    ({"remat.policy": "nothing_saveable", "remat.modules": ("Block",)},
     r"config.remat.modules names \['Block'\], but the model has no module of that class; its "
     r"module classes are \['BatchNorm', 'Dense', 'Dropout', 'FlaxStyleNet'\]"),
])
def test_remat_settings_that_cannot_work_are_refused_before_training(overrides, message):
  with pytest.raises(ValueError, match=message):
    trainer = user_models.FlaxStyleTrainer(_cnn_config(**overrides))
    trainer.init_state(image_batches(1, 16)[0])
