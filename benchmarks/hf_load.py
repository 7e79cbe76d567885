r"""Host memory of loading a Hugging Face checkpoint: whole, onto one device, and FSDP-sharded.

    python benchmarks/hf_load.py [--devices 8] [--layers 8] [--embed 512] [--vocab 8192]

Writes a randomly initialised GPT-2 of the given size as an HF checkpoint
(`model.safetensors`, by this project's exporter), then loads it three ways in one
run, each measured with `tracemalloc` (host allocations: Python and NumPy buffers,
not the devices' own memory):

- `safetensors load_file`: the whole file into NumPy arrays, the baseline (what a
  loader that converts on the host and then places holds at once);
- `single_device`: `config.init_from.path` onto one device (every slice is a whole
  tensor);
- `fsdp`: the same onto `--devices` devices with `embed -> data`: each device's shard
  is read from the file on its own (safetensors' lazy slices), so the host never
  holds more than a slice at a time.

Printed per row: the peak host bytes during the load, that peak as a fraction of the
model's bytes, the largest single read from the file, and the load's wall time
(compiling the init and the optimizer's state included; the imports a first trainer
makes are done before measuring).
On CPU the "devices" live in host memory too, but outside what tracemalloc counts.
"""

import argparse
import os
import sys
import tempfile
import time
import tracemalloc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--devices", type=int, default=8, help="host CPU devices to make")
  parser.add_argument("--layers", type=int, default=8)
  parser.add_argument("--embed", type=int, default=512)
  parser.add_argument("--vocab", type=int, default=8192)
  args = parser.parse_args()
  from trainer.distributed import devices
  devices.initialize(args.devices)

  import jax
  import ml_collections
  import numpy as np
  from safetensors.numpy import load_file

  from configs import finetune_lm, lm
  from trainer import LanguageModelTrainer
  from trainer.interop import hf
  from trainer.step.model_variables import create

  fields = dict(family="gpt2", vocab_size=args.vocab, num_layers=args.layers,
                embed_dim=args.embed, num_heads=8, mlp_dim=4 * args.embed, max_len=128,
                layer_norm_epsilon=1e-5, dropout_rate=0.0)
  directory = tempfile.mkdtemp(prefix="hf_load_")
  model = create(hf.families.get("gpt2").build(fields))
  tokens = np.zeros((1, 16), np.int32)
  params = jax.jit(lambda rng: model.init({"params": rng}, ((tokens,), {}))[0])(
      jax.random.PRNGKey(0))
  from trainer.checkpoint.init_from import variables_by_collection
  hf.export(variables_by_collection(jax.device_get(params), {}, linen=True)["params"], fields,
            directory)
  del params
  model_bytes = os.path.getsize(os.path.join(directory, hf.WEIGHTS))
  print(f"GPT-2 {args.layers} layers x {args.embed} wide, vocab {args.vocab}: "
        f"{model_bytes / 2**20:.1f} MiB of float32 weights; {len(jax.devices())} devices")

  def config_for(layout):
    config = finetune_lm.get_config()
    config.model = ml_collections.ConfigDict(hf.model_fields(directory))
    config.init_from.path = directory
    config.seq_len, config.batch_size = 16, 8 * max(1, args.devices)
    if layout == "single_device":
      config.strategy.name = "single_device"
    else:
      config.strategy.logical_axis_rules = lm.rules(embed="data")
    return config

  def measure(name, load):
    tracemalloc.start()
    tracemalloc.reset_peak()
    start = time.perf_counter()
    largest = load()
    seconds = time.perf_counter() - start
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    print(f"{name:<24} {peak / 2**20:>10.1f} {peak / model_bytes:>8.3f} "
          f"{largest / 2**20:>12.2f} {seconds:>8.2f}")

  print(f"{'load':<24} {'peak MiB':>10} {'/model':>8} {'largest read':>12} {'seconds':>8}")

  def whole():
    arrays = load_file(os.path.join(directory, hf.WEIGHTS))
    return max(a.nbytes for a in arrays.values())

  def through_trainer(layout):
    def load():
      trainer = LanguageModelTrainer(config_for(layout))
      batch = {"inputs": np.zeros((trainer.config.batch_size, 16), np.int32),
               "targets": np.zeros((trainer.config.batch_size, 16), np.int32)}
      state = trainer.init_state(batch)
      jax.block_until_ready(state)
      return trainer.states.source.handle.largest_read
    return load

  # What the first trainer imports (TensorFlow, through clu and tfds) is not the load's.
  warm = config_for("single_device")
  warm.init_from.path = ""
  LanguageModelTrainer(warm).states.abstract(
      {"inputs": np.zeros((8, 16), np.int32), "targets": np.zeros((8, 16), np.int32)})
  measure("safetensors load_file", whole)
  measure("single_device", through_trainer("single_device"))
  measure(f"fsdp ({len(jax.devices())} devices)", through_trainer("fsdp"))


if __name__ == "__main__":
  main()
