"""Fields every runnable config has; the setup configs start from these.

Every strategy's fields are present, so switching strategy is one override:
`--config.strategy.name=...`.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.seed = 0  # Params, member RNGs and data order all derive from it.
  config.batch_size = 128  # Global: split over data replicas, whole for each ensemble member.
  config.eval_batch_size = 128  # Short final eval batches are padded and masked.
  config.num_train_steps = 1000
  config.log_every_steps = 100
  config.eval_every_steps = 0  # 0: evaluate only at the end.

  # A non-finite loss or gradient norm: "stop" raises naming the step (the
  # latest checkpoint stays the last finite state); "skip" leaves the update
  # out, counts it (train/skipped_steps) and goes on.
  config.nonfinite = "stop"

  # Orbax checkpoints in <workdir>/checkpoints (when the entry point has a
  # workdir). A run in a workdir that holds one resumes from the latest.
  config.checkpoint = ml_collections.ConfigDict()
  config.checkpoint.every_steps = 1000  # Also at the end and on SIGTERM; 0: only then.
  config.checkpoint.max_to_keep = 3
  config.checkpoint.async_save = True  # Training continues while a save is written.

  config.optimizer = "sgd"  # One of trainer.optim.OPTIMIZERS.
  config.learning_rate = 0.1
  config.momentum = 0.9

  config.strategy = ml_collections.ConfigDict()
  config.strategy.name = "single_device"  # See strategies.available().
  # sharded_data_parallel: mesh over all devices; -1 takes the remaining devices.
  config.strategy.mesh_shape = (-1,)
  config.strategy.mesh_axes = ("data",)
  # Logical axis name -> mesh axis; the rule for 'batch' shards the batch.
  config.strategy.logical_axis_rules = (("batch", "data"),)
  # sharded_ensemble: devices on the (ensemble, data) mesh axes; members are
  # split over 'ensemble' (ensemble_size must be a multiple of it), each
  # member's batch over 'data'. -1 takes the remaining devices.
  config.strategy.ensemble_mesh_shape = (-1, 1)
  # sharded_ensemble: how the members sharing a device run: "unroll" (one copy
  # of the step per member), "map" (a lax.map loop), "vmap", or "" for the
  # platform's fastest (strategies.sharded_ensemble.default_loop).
  config.strategy.ensemble_loop = ""
  return config
