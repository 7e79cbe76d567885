"""The 16-configuration learning-rate grid of `configs/mnist_sweep.py`, trained with
successive halving in 8 slots: one compiled program that stops the weak configurations
early and gives their slots to the ones not yet tried.

    python examples/mnist_ensemble.py --config=configs/mnist_halving.py \
        --workdir=/tmp/mnist_halving

Each configuration trains at most the grid's run length (`num_epochs`). Every
`eval_every_steps` every slot is evaluated; a configuration that reaches a rung
(`halving.min_steps` steps, then 4x that, ...) goes on only while its accuracy is in
the top quarter of all configurations that reached that rung. A stopped one's slot
starts the next configuration from its seed; with none left, the slot is frozen. The
run ends when every configuration has stopped or completed (`sweep.json` has each
one's history; `sweep_curves.png` their accuracy against steps).
"""

import ml_collections

from configs import mnist_sweep


def get_config() -> ml_collections.ConfigDict:
  config = mnist_sweep.get_config()
  config.ensemble_size = 8  # Slots: 1 per device; the 16 configurations take turns.
  config.sweep.scheduler = "halving"
  config.sweep.halving.reduction_factor = 4.0  # Keep the top quarter at each rung.
  config.num_epochs = 1
  config.eval_every_steps = 36  # 13 per epoch of 468 steps (batch 128).
  config.sweep.halving.min_steps = 36  # Rungs at 36 and 144 steps of a configuration's own.
  config.steps_per_call = 4
  config.data.eval_split = "test[:2000]"  # What the choices are made on (every 36 steps).
  return config
