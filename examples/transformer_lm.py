r"""Trains the small transformer LM under any layout, on a text corpus or synthetic tokens.

    python examples/transformer_lm.py --config=configs/lm.py:fsdp --workdir=/tmp/lm
    python examples/write_corpus.py --out=/tmp/corpus
    python examples/transformer_lm.py --workdir=/tmp/lm_corpus \
        --config.data.sources='("/tmp/corpus/train-*.jsonl.gz",)' \
        --config.data.eval_sources='("/tmp/corpus/valid.jsonl",)' \
        --config.data.tokenizer=/tmp/corpus --config.model.vocab_size=512

With `config.data.sources` the batches are the corpus's documents, tokenized and
packed by `trainer.data.lm` (Grain), each process reading its own share, the
position saved with every checkpoint; without, a synthetic token stream.

The layout (data parallel, FSDP, tensor parallel, data x tensor, FSDP x
tensor) is the config string; the model and the loop are the same for all.
The strategy summary (mesh, per-parameter specs, bytes per device) is logged
at the start. Checkpoints and metrics go to `--workdir`; rerunning resumes.
"""

import os
import sys

from absl import app, flags, logging

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trainer import config as config_lib  # noqa: E402  (no jax: safe before devices)
from trainer.run import workdir as workdir_lib  # noqa: E402

FLAGS = flags.FLAGS
# An ml_collections config file, locked: an override must name one of its fields.
config_lib.define_config_file(
    os.path.join(os.path.dirname(__file__), "..", "configs", "lm.py"),
    "Training configuration (configs/lm.py:<layout>).")
flags.DEFINE_string("workdir", None, "Directory for checkpoints, TensorBoard events and "
                    "metrics.jsonl.")
flags.DEFINE_integer("num_cpu_devices", 8, "Host devices to make on a CPU-only machine.")
flags.mark_flags_as_required(["workdir"])
# A --workdir that cannot be a directory is refused while the flags are parsed.
flags.register_validator("workdir", workdir_lib.flag_validator)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  from trainer.distributed import devices
  devices.initialize(FLAGS.num_cpu_devices)
  with devices.naming_the_process():
    train(FLAGS.config, FLAGS.workdir)


def train(config, workdir: str) -> None:
  import itertools

  from trainer import LanguageModelTrainer, writers
  from trainer.checkpoint import Checkpointer
  from trainer.distributed.devices import is_primary
  from trainer.language_model import synthetic_token_batches

  trainer = LanguageModelTrainer(config)
  checkpointer = Checkpointer.from_config(config, workdir)
  rows = trainer.strategy.process_slice(config.batch_size)  # This process's rows.
  writer = writers.create_writer(workdir, config.writers, config)
  actions = []
  if config.data.sources or config.data.eval_sources:
    from trainer.data import lm  # Grain: imported only where text files are read.
  if config.data.sources:  # Text files: tokenized, packed, this process's lanes.
    stream = lm.from_config(config, rows)
    actions.append(lm.CorpusMetrics(writer, every_steps=config.log_every_steps))
  else:
    stream = lambda start: synthetic_token_batches(  # noqa: E731
        config.seed, config.batch_size, config.seq_len, config.model.vocab_size, start, rows)
  # Eval batches are global: each process passes all, the Trainer puts its rows.
  if config.data.eval_sources:
    held_out = lm.eval_batches(config)
  else:
    held_out = list(itertools.islice(synthetic_token_batches(
        config.seed, config.batch_size, config.seq_len, config.model.vocab_size, 10**6), 4))
  try:
    result = trainer.fit(stream, num_steps=config.num_train_steps, checkpointer=checkpointer,
                         writer=writer, eval_batches=lambda: held_out, workdir=workdir,
                         actions=actions)
  finally:
    checkpointer.close()
    writer.close()
  if result.final_eval and is_primary():
    logging.info("Final eval: %s", result.final_eval)
    print(" ".join(f"{k}={v:.4f}" for k, v in sorted(result.final_eval.items())))


if __name__ == "__main__":
  # An override of a field the config lacks is refused naming the field (and, under
  # sweep.grid, what can be swept) instead of ml_collections' bare AttributeError.
  config_lib.run(main)
