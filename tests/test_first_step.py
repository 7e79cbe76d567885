"""What a run does before its first step: each piece of work once, and no import it does
not use (benchmarks/first_step.py measures the time)."""

import pathlib
import subprocess
import sys

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
from small_configs import tiny_lm_config

from trainer import Trainer

ROOT = pathlib.Path(__file__).resolve().parent.parent
TRACES = []


class Counted(nn.Module):
  """A Dense layer that counts how often it is traced."""

  @nn.compact
  def __call__(self, x):
    TRACES.append(1)
    return nn.Dense(4, kernel_init=nn.with_logical_partitioning(
        nn.initializers.lecun_normal(), ("embed", "mlp")))(x)


class CountedTrainer(Trainer):
  def build_model(self):
    return Counted()

  def loss(self, outputs, batch):
    return jnp.mean((outputs - batch["targets"]) ** 2, axis=-1)


def test_a_second_state_for_the_same_batch_shapes_is_not_traced_or_compiled_again():
  """`init_state` twice on one trainer (the fine-tune example evaluates the loaded model,
  then trains it; a sweep refill asks again): the init is traced and compiled once."""
  config = tiny_lm_config("fsdp")
  config.strategy.logical_axis_rules = (("batch", "data"), ("embed", "data"), ("mlp", None))
  trainer = CountedTrainer(config)
  batch = {"inputs": np.ones((16, 8), np.float32), "targets": np.zeros((16, 4), np.float32)}
  first = trainer.init_state(batch)
  traced = len(TRACES)
  assert traced >= 1
  second = trainer.init_state(batch)
  assert len(TRACES) == traced
  np.testing.assert_array_equal(np.asarray(first.params["Dense_0"]["kernel"].value),
                                np.asarray(second.params["Dense_0"]["kernel"].value))
  trainer.init_state({k: v[:8] for k, v in batch.items()})  # Other shapes: traced again.
  assert len(TRACES) > traced


def test_a_language_model_run_never_imports_tensorflow(tmp_path):
  """The LM example (TensorBoard events, metrics.jsonl, a checkpoint) reads no TFDS data,
  so nothing it does needs TensorFlow or tensorflow-datasets: not the metric writers, not
  the checkpoints, not `trainer.data`."""
  script = (
      "import runpy, sys\n"
      f"sys.argv = ['transformer_lm.py', '--config=configs/lm.py', '--workdir={tmp_path}',\n"
      "  '--config.num_train_steps=2', '--config.log_every_steps=1',\n"
      "  '--config.eval_every_steps=0', '--config.schedule.warmup_steps=0']\n"
      "try:\n"
      "  runpy.run_path('examples/transformer_lm.py', run_name='__main__')\n"
      "except SystemExit as e:\n"
      "  assert not e.code, e.code\n"
      "imported = [m for m in ('tensorflow', 'keras', 'tensorflow_datasets')\n"
      "            if m in sys.modules]\n"
      "assert not imported, imported\n")
  subprocess.run([sys.executable, "-c", script], check=True, cwd=ROOT, timeout=300)
  assert list(tmp_path.glob("events.out.tfevents.*"))


def test_the_programs_of_earlier_test_files_are_let_go():
  """Each loaded XLA:CPU program holds memory mappings, and jax's caches keep every one (an
  eager op on a new shape is a program too): a worker that ran file after file crashed at
  the kernel's 65,530. Between files the suite drops them (`conftest._release_programs`)."""
  import conftest
  before = conftest._memory_maps()
  for n in range(1, 41):  # 40 eager programs, as a test file's checks make.
    (jnp.tanh(jnp.ones((n, 3))) @ jnp.ones((3, n + 1))).block_until_ready()
  loaded = conftest._memory_maps()
  conftest._release_programs()
  after = conftest._memory_maps()
  assert loaded - before >= 40, (before, loaded)
  assert after - before < (loaded - before) / 2, (before, loaded, after)
