"""Fields every runnable config has; the setup configs start from these.

Every strategy's fields are present, so switching strategy is one override:
`--config.strategy.name=...`.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.seed = 0  # Params, member RNGs and data order all derive from it.
  # The Trainer this config is written for, `path/to/file.py:Class` or `module:Class`, for
  # tools that build one from a config alone (the dry run, `python -m trainer.plan`); the
  # examples build their own. Its module defines `example_batch(config)`: one batch's shapes.
  config.trainer = ""
  config.batch_size = 128  # Global: split over data replicas, whole for each ensemble member.
  config.eval_batch_size = 128  # Short final eval batches are padded and masked.
  config.num_train_steps = 1000  # The run's length; decaying schedules span it. <= 0: unset.
  # With num_train_steps <= 0: this many passes over the train split (setups
  # that read a dataset turn it into steps, trainer.data.num_train_steps).
  config.num_epochs = 0
  config.log_every_steps = 100
  config.eval_every_steps = 0  # 0: evaluate only at the end.

  # A non-finite loss or gradient norm: "stop" raises naming the step (the
  # latest checkpoint stays the last finite state); "skip" leaves the update
  # out, counts it (train/skipped_steps) and goes on.
  config.nonfinite = "stop"
  # Train batches put on the devices ahead of their step (0: each at its step), so that
  # reading and copying the next batch overlap the running step.
  config.prefetch_to_device = 1
  # Train steps per compiled call (a lax.scan over the steps): the host dispatches
  # once per call instead of once per step, which is what bounds small models on
  # accelerators. Per-step results are unchanged: metrics are written per step, a
  # non-finite step is reported by its own number, and a call ends early where an
  # action needs the state (a checkpoint or evaluation step), so at most two call
  # lengths are compiled (trainer.loop.chunks).
  config.steps_per_call = 1
  # How a call's steps run: "scan" (a lax.scan loop: compiles once for any count),
  # "unroll" (straight-line code), or "" for the platform's default
  # (trainer.step.functions.default_steps_loop: unroll on CPU, where convolutions
  # in a loop are slow; scan elsewhere).
  config.steps_loop = ""

  # Exit when no train call or action finishes for this long (0: off): every thread's
  # stack goes to the log, half-written checkpoints are removed, and the process exits
  # with status 75 (trainer/loop/timing.py), which the launcher's --max_restarts and
  # cluster schedulers restart. Compilation, evaluation and checkpoint saves get
  # watchdog_slow_seconds (0: 10x watchdog_seconds).
  config.watchdog_seconds = 0.0
  config.watchdog_slow_seconds = 0.0

  # Where metrics go besides the console (trainer/writers.py): "tensorboard" (event
  # files), "jsonl" (metrics.jsonl), "wandb" (Weights & Biases, from process 0, the same
  # run after a restart; pip install -e '.[wandb]').
  config.writers = ("tensorboard", "jsonl")
  config.wandb = ml_collections.ConfigDict()
  config.wandb.project = "flax-trainer"
  config.wandb.entity = ""  # "": the account's default.
  config.wandb.mode = ""  # "online", "offline", "disabled"; "": $WANDB_MODE, else online.

  # Orbax checkpoints in <workdir>/checkpoints (when the entry point has a
  # workdir). A run in a workdir that holds one resumes from the latest.
  config.checkpoint = ml_collections.ConfigDict()
  config.checkpoint.every_steps = 1000  # Also at the end and on SIGTERM; 0: only then.
  config.checkpoint.max_to_keep = 3
  config.checkpoint.async_save = True  # Training continues while a save is written.
  # Keep the `keep_best` best checkpoints by this eval metric beside the latest
  # ones (a checkpoint is then also saved at every evaluation). "": off.
  config.checkpoint.best_metric = ""
  config.checkpoint.best_mode = "max"  # "max" (accuracy) or "min" (loss).
  config.checkpoint.keep_best = 1
  # On resume, an unreadable latest checkpoint (no commit marker, a truncated or lost
  # array) is renamed <step>.corrupt-<time> and the newest readable one resumed
  # ("fallback"), or the run stops with the error ("error").
  config.checkpoint.on_corrupt = "fallback"
  # A save that fails (disk full, quota, permissions): "stop" ends the run with the error
  # (the previous checkpoint is untouched); "continue" logs it and saves at the next step.
  config.checkpoint.on_save_error = "stop"

  # -- The optimizer recipe (trainer/optim.py) --
  config.optimizer = "sgd"  # One of trainer.step.optim.OPTIMIZERS: sgd, adam, adamw.
  config.learning_rate = 0.1  # The peak rate, after warmup.
  config.momentum = 0.9  # sgd; 0 for plain SGD.
  config.b1 = 0.9  # adam, adamw: the first moment's decay.
  # Decoupled for adamw, added to the gradient (L2) for sgd/adam. Applies to
  # kernels and embeddings only, never to biases or norm scales.
  config.weight_decay = 0.0
  config.grad_clip_norm = 0.0  # Clip the (accumulated) gradient to this global norm; 0: off.
  # Parameters by path pattern (a regex matching the whole `/`-joined path, e.g.
  # "Conv_.*/kernel"): `freeze` ones stay unchanged and carry no optimizer state;
  # `param_groups` is a tuple of {"pattern", "lr_scale", "weight_decay"} dicts, each
  # group with its own learning-rate multiplier and weight decay (trainer/step/optim.py).
  config.freeze = ()
  config.param_groups = ()

  # Start from an earlier run's variables (trainer/checkpoint/init_from.py): a workdir,
  # checkpoints or step directory of this project (any strategy), an orbax PyTree
  # directory or a Flax msgpack file. `rules`: (new path pattern, old path) pairs, applied
  # in params and in every model_state collection alike (empty: each path from itself);
  # `fresh`: patterns that keep their initialisation (a new head). The optimizer state
  # starts fresh. Applies when a run starts, not when it resumes from its own checkpoint.
  config.init_from = ml_collections.ConfigDict()
  config.init_from.path = ""  # "": off.
  config.init_from.step = -1  # -1: the latest checkpoint.
  config.init_from.member = -1  # An ensemble checkpoint: the member every new model takes.
  config.init_from.rules = ()
  config.init_from.fresh = ()
  # A PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors) whose
  # adapters start config.lora's, over the base in init_from.path (trainer/interop/peft.py).
  config.init_from.adapters = ""
  # LoRA (trainer/step/lora.py, Qwix's adapters; Linen models): low-rank adapters of `rank`
  # on the weights whose parameter paths the `targets` regexes match, scaled by
  # alpha / rank; every other parameter is frozen (no optimizer state). 0: off.
  config.lora = ml_collections.ConfigDict()
  config.lora.rank = 0
  config.lora.alpha = 16.0
  config.lora.targets = ()
  # QLoRA (trainer/step/quantized_base.py, Qwix's quantized arrays): the frozen base weights
  # the `quantize` regexes match (default: every kernel but an output head's) stored as
  # `base_dtype` ('': their own dtype; 'nf4' or 'int8', one scale per `block_size` values
  # of a weight's last input axis for each output; 'bfloat16', cast).
  config.lora.base_dtype = ""
  config.lora.block_size = 64
  config.lora.quantize = (r"(?!(.*/)?(lm_head|head|logits)/).*kernel",)
  # A mixture of experts' router losses (models/moe.py; a model whose output is
  # `MoeOutput`): weights of the load-balancing loss (Switch/Mixtral form, `top_k` when
  # balanced) and of the router z-loss, both added to every example's loss and logged.
  config.moe = ml_collections.ConfigDict()
  config.moe.load_balance_weight = 0.01
  config.moe.router_z_weight = 0.001
  config.schedule = ml_collections.ConfigDict()
  config.schedule.name = "constant"  # constant | cosine | linear (decay to the last step).
  config.schedule.warmup_steps = 0  # Linear warmup from 0 to learning_rate.
  config.schedule.end_factor = 0.0  # cosine/linear: the final rate, as a fraction of the peak.

  # Split each batch into this many microbatches inside one compiled step (a
  # scan) and average their gradients: one update per batch, the memory of a
  # microbatch. Must divide each data replica's share of batch_size.
  config.grad_accum_steps = 1
  # How the microbatches run: "scan" (a loop: one microbatch's activations live
  # at a time), "unroll" (straight-line code), or "" for the platform's default
  # (trainer.step.accumulation.default_loop: unroll on CPU, where convolutions in a
  # loop are slow; scan elsewhere).
  config.grad_accum_loop = ""
  # bfloat16 (or float16) compute with float32 parameters and optimizer state.
  config.mixed_precision = ml_collections.ConfigDict()
  config.mixed_precision.compute_dtype = "float32"  # float32 | bfloat16 | float16.
  config.mixed_precision.loss_scale = 0.0  # Static; 0: 2**12 for float16, 1 otherwise.
  # How the shared attention (models/attention.py) runs where no `context` axis splits the
  # sequence: "plain" (each head's whole score matrix) or "blockwise" (blocks of
  # `block_size` queries and keys, an online softmax, memory linear in the length).
  config.attention = ml_collections.ConfigDict()
  config.attention.method = "plain"
  config.attention.block_size = 512
  # What runs the blockwise method: "auto" (on a GPU cuDNN's fused kernel where it can
  # express the call, XLA's blockwise schedule elsewhere), "xla" or "cudnn" (refused where
  # the fused kernel cannot run the call).
  config.attention.implementation = "auto"
  # Rematerialisation (trainer/step/remat.py): recompute activations in the backward pass.
  # `policy`: a jax.checkpoint_policies name (nothing_saveable, dots_saveable,
  # dots_with_no_batch_dims_saveable, ...); "": off. `modules`: module class names whose
  # calls are checkpointed one by one (a Transformer's blocks: ("DecoderBlock",)); empty:
  # the whole forward pass as one piece.
  config.remat = ml_collections.ConfigDict()
  config.remat.policy = ""
  config.remat.modules = ()
  # Exponential moving average of the parameters, evaluated beside them as
  # eval/ema_*, checkpointed with the state. 0: off; 0.999 is typical.
  config.ema_decay = 0.0
  # Loss spikes (trainer/step/spikes.py): skip an update whose loss exceeds `factor` x the
  # median of the last `window` accepted losses, once `warmup` are recorded. Decided on
  # the device, per member in an ensemble; counted as train/spike_skips; checkpointed.
  config.spikes = ml_collections.ConfigDict()
  config.spikes.skip = False
  config.spikes.factor = 3.0
  config.spikes.window = 100
  config.spikes.warmup = 20

  # Stop when the eval metric has not improved by min_delta for `patience`
  # evaluations (needs eval_every_steps > 0). "": off.
  config.early_stopping = ml_collections.ConfigDict()
  config.early_stopping.metric = ""
  config.early_stopping.mode = "min"  # "min" (loss) or "max" (accuracy).
  config.early_stopping.patience = 3
  config.early_stopping.min_delta = 0.0

  # A jax.profiler trace of steps first_step+1 .. first_step+num_steps into
  # logdir (default: the workdir), for TensorBoard's profile tab or Perfetto.
  config.profile = ml_collections.ConfigDict()
  config.profile.first_step = 10
  config.profile.num_steps = 0  # 0: no profile.
  config.profile.logdir = ""

  # Bind every BatchNorm that has no axis_name to the step's data axis, so its
  # statistics are over the global batch (Lightning's sync_batchnorm). Without
  # it such a layer is refused where a step sees a shard of the batch (pmap DP).
  config.sync_batchnorm = False

  # Ensemble strategies: how many members; 0 puts one member on each device
  # (pmap_ensemble: each local device; sharded_ensemble: every device).
  config.ensemble_size = 0
  # CPU-only hosts: how many host devices the entry point makes before jax
  # starts (0: leave jax's default). No effect on GPU/TPU hosts.
  config.num_cpu_devices = 0

  # Sweeps as ensembles (trainer/sweep/): under an ensemble strategy each member trains
  # with its own optimizer hyperparameters and seed, one compiled program for all.
  # `grid`: name -> values, every combination; or `points`: a tuple of {name: value}
  # dicts; either times `seeds` (empty: config.seed). The member count follows
  # (ensemble_size 0 takes it). Empty everywhere: no sweep.
  config.sweep = ml_collections.ConfigDict()
  config.sweep.grid = ml_collections.ConfigDict()
  for name in ("learning_rate", "weight_decay", "momentum", "b1", "grad_clip_norm",
               "warmup_steps", "ema_decay", "beta"):
    config.sweep.grid[name] = ()
  config.sweep.points = ()
  config.sweep.seeds = ()
  # The best member by this eval metric ("": the first eval metric) is reported and
  # exported as a single-model checkpoint (<workdir>/sweep_best).
  config.sweep.metric = ""
  config.sweep.mode = "max"  # "max" (accuracy) or "min" (loss).
  # Sweeps that choose (trainer/sweep/schedulers.py), decided at each evaluation:
  # "" trains every member to the end; "halving" (asynchronous successive halving: a
  # member below the top 1/reduction_factor at a rung stops, and its slot takes the next
  # configuration; ensemble_size may then be below the sweep's count); "pbt"
  # (population-based training: the bottom `fraction` copy the top and explore).
  config.sweep.scheduler = ""
  # A learning-rate range test (trainer/sweep/lr_find.py): with sweep.grid.learning_rate
  # log-spaced, record each member's train loss every step and suggest a rate at the end.
  config.sweep.lr_find = False
  config.sweep.halving = ml_collections.ConfigDict()
  config.sweep.halving.rungs = ()  # Ages (a member's own steps) compared at; () derives them:
  config.sweep.halving.min_steps = 0  # First rung (0: eval_every_steps), then x reduction.
  config.sweep.halving.reduction_factor = 2.0
  config.sweep.pbt = ml_collections.ConfigDict()
  config.sweep.pbt.ready_steps = 0  # How often (0: every evaluation).
  config.sweep.pbt.fraction = 0.25  # Bottom quarter copies the top quarter.
  config.sweep.pbt.perturb = (0.8, 1.2)  # A copied value times one of these...
  config.sweep.pbt.resample_probability = 0.25  # ...or drawn afresh from its range.
  # name -> (low, high) per swept name explored (default: the sweep's smallest, largest).
  config.sweep.pbt.ranges = ml_collections.ConfigDict()
  for name in ("learning_rate", "weight_decay", "momentum", "b1", "grad_clip_norm",
               "warmup_steps", "ema_decay", "beta"):
    config.sweep.pbt.ranges[name] = ()
  # An Optuna study as the sweep's source of configurations (trainer/sweep/study.py): each
  # ensemble slot is one of the study's concurrent trials, asked from the sampler, pruned
  # by the pruner at evaluations, and refilled with the next trial until n_trials. On when
  # `space` names a distribution: (kind, ...) with kind "float" (low, high), "log" (low,
  # high: log-uniform), "int" (low, high) or "categorical" (values...).
  config.sweep.study = ml_collections.ConfigDict()
  config.sweep.study.space = ml_collections.ConfigDict()
  for name in ("learning_rate", "weight_decay", "momentum", "b1", "grad_clip_norm",
               "warmup_steps", "ema_decay", "beta"):
    config.sweep.study.space[name] = ()
  config.sweep.study.n_trials = 32  # Trials in the study, over every run that shares it.
  config.sweep.study.sampler = "tpe"  # tpe, random, cmaes, gp, qmc (seeded by config.seed).
  # median, successive_halving, hyperband (Optuna's), halving (sweep.halving's rungs), none.
  config.sweep.study.pruner = "median"
  config.sweep.study.startup_trials = 5  # Trials the median pruner waits for.
  # "": an Optuna journal file in the workdir (<workdir>/study.journal); a path: that
  # journal file (runs that name one file share the study); or an Optuna database URL
  # (sqlite:///..., postgresql://..., mysql://...).
  config.sweep.study.storage = ""
  config.sweep.study.name = "sweep"

  config.strategy = ml_collections.ConfigDict()
  config.strategy.name = "single_device"  # See strategies.available().
  # sharded_data_parallel: mesh over all devices; -1 takes the remaining devices.
  config.strategy.mesh_shape = (-1,)
  config.strategy.mesh_axes = ("data",)
  # Logical axis name -> mesh axis; the rule for 'batch' shards the batch. A parameter
  # dimension annotated with a mesh axis name the table does not map is laid out on it.
  config.strategy.logical_axis_rules = (("batch", "data"),)
  # sharded_data_parallel: "auto" (the partitioner propagates layouts; Flax's pjit guide) or
  # "explicit" (shardings are part of the array types; Flax's current NNX examples).
  config.strategy.axis_types = "auto"
  # sharded_data_parallel: a parameter larger than this (MiB) replicated over a mesh axis
  # that does not split the batch is an error (0: no limit).
  config.strategy.max_replicated_mb = 256.0
  # sharded_data_parallel with a 'stage' mesh axis (and the rule ('layer', 'stage')): the
  # model's layer stack (models.layer_stack) is pipelined over it (strategies/pipeline.py).
  # `microbatches`: pieces of each batch (0: one per stage; more shrinks the bubble,
  # (stages-1)/(microbatches*repeats+stages-1)); `repeats`: layer groups per stage (1:
  # GPipe; more: the circular schedule); `remat`: recompute each stage's layers in the
  # backward pass, keeping only its inputs.
  config.strategy.pipeline = ml_collections.ConfigDict()
  config.strategy.pipeline.microbatches = 0
  config.strategy.pipeline.repeats = 1
  config.strategy.pipeline.remat = False
  # sharded_data_parallel with a 'context' mesh axis (and the rule ('length', 'context')):
  # every sequence is split over it (strategies/context.py) and the model's attention
  # (models.attention.attention) runs by `method`: "all_gather" (keys and values gathered
  # over the axis) or "ring" (passed round it, softmax combined online). `load_balance`:
  # hold each sequence in the load-balanced causal order (device i: chunks i and
  # 2*context-1-i), so causal attention's work is equal on every device.
  config.strategy.context = ml_collections.ConfigDict()
  config.strategy.context.method = "all_gather"
  config.strategy.context.load_balance = True
  # sharded_ensemble: devices on the (ensemble, data) mesh axes; members are
  # split over 'ensemble' (ensemble_size must be a multiple of it), each
  # member's batch over 'data'. -1 takes the remaining devices.
  config.strategy.ensemble_mesh_shape = (-1, 1)
  # sharded_ensemble: how the members sharing a device run: "unroll" (one copy
  # of the step per member), "map" (a lax.map loop), "vmap", or "" for the
  # platform's fastest (strategies.sharded_ensemble.default_loop).
  config.strategy.ensemble_loop = ""
  # sharded_ensemble: the frozen parts every member reads from one copy (trainer.run.shared):
  # "auto" (a LoRA/QLoRA or frozen base that init_from loads, a 'copy' reference of loaded
  # weights, a distillation teacher), "none" (each member its own), or a comma-separated
  # list of "base", "reference", "teacher" (each must be the same in every member).
  config.strategy.share_frozen = "auto"
  return config
