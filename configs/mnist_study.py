"""An Optuna study inside one compiled program: 32 trials of the MNIST CNN through 8 ensemble
slots, asked from a seeded TPE sampler and pruned by the median pruner.

    python examples/mnist_ensemble.py --config=configs/mnist_study.py \
        --workdir=/tmp/mnist_study

Each slot is one of the study's concurrent trials: it trains with the trial's
learning rate, momentum and weight decay (in its optimizer state), reports its
test accuracy every `eval_every_steps` of its own steps, and when the pruner
stops it, or it ends its epoch, its slot asks the study for the next trial and
starts it from `config.seed`. Nothing recompiles. The study lives in
`<workdir>/study.journal` (an Optuna journal file): open it with
`optuna-dashboard <workdir>/study.journal`. Rerun the command in the same workdir
to resume after a crash; name one storage in two runs
(`--config.sweep.study.storage=/shared/study.journal`) and they share its trials.
"""

import ml_collections

from configs import mnist_ensemble


def get_config() -> ml_collections.ConfigDict:
  config = mnist_ensemble.get_config()
  config.strategy.name = "sharded_ensemble"
  config.ensemble_size = 8  # Slots: the study's concurrent trials.
  config.num_cpu_devices = 8  # CPU-only hosts; no effect on GPU/TPU.
  config.optimizer = "sgd"
  config.sweep.metric = "accuracy"
  config.sweep.mode = "max"
  config.sweep.study.space.learning_rate = ("log", 0.003, 0.5)
  config.sweep.study.space.momentum = ("float", 0.0, 0.95)
  config.sweep.study.space.weight_decay = ("log", 1e-6, 1e-3)
  config.sweep.study.n_trials = 32
  config.sweep.study.sampler = "tpe"
  config.sweep.study.pruner = "median"
  config.sweep.study.startup_trials = 4
  config.sweep.halving.min_steps = 72  # The median pruner waits this many steps of a trial's.
  config.nonfinite = "skip"  # A diverging trial skips its updates; the others go on.
  config.num_epochs = 1  # Each trial's length: one epoch (468 steps at batch 128).
  config.eval_every_steps = 36
  config.data.eval_split = "test[:2000]"  # What the trials report and are pruned on.
  config.data.pipeline = "device"  # The split on the devices, 4 steps a call.
  config.steps_per_call = 4
  return config
