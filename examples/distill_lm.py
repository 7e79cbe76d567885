r"""On-policy distillation: a small student trained on its own samples against a bigger
teacher's per-token distributions.

    python examples/distill_lm.py --workdir=/tmp/distill
    python examples/distill_lm.py --config=configs/distill.py:gkd --workdir=/tmp/gkd

- The teacher: `--config.distill.teacher` (an HF directory of the student's vocabulary, or
  a run's workdir); without one, the example first trains a GPT-2 of 4 layers x 128
  (`config.teacher`) on this repository's docs and exports it to `<workdir>/teacher/hf`.
- The records: a prompt per docs paragraph (its first 8 words; every tenth held out) and
  the teacher's own sampled completion of it (`<workdir>/records`): the records' batches
  GKD's `lmbda` leaves off-policy, and the held-out text the student's `nll` is measured on.
- The student: a GPT-2 of 2 layers x 64 (the fine-tune example's model, random), trained
  `config.num_train_steps` steps by `DistillationTrainer` (`trainer.distill`): each step's
  completions the student's own samples (with probability `config.distill.lmbda`), the
  loss TRL's generalized JSD to the teacher.

The example prints the held-out reverse KL to the teacher (on the student's samples) and
the student's NLL of the teacher's held-out completions, before and after, and exports
the student as an HF model (`<workdir>/hf`). `benchmarks/distill.py` compares it with
supervised training on the teacher's samples (off-policy distillation). With
`--harness_tasks` it runs lm-evaluation-harness tasks during training.
"""

import json
import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lm_setup  # noqa: E402

from trainer import config as config_lib  # noqa: E402  (no jax: safe before devices)
from trainer.run import workdir as workdir_lib  # noqa: E402

FLAGS = flags.FLAGS
config_lib.define_config_file(os.path.join(lm_setup.ROOT, "configs", "distill.py"),
                              "Distillation configuration (configs/distill.py:<variant>).")
flags.DEFINE_string("workdir", None, "Directory for the teacher, the records, checkpoints, "
                    "metrics and the export.")
flags.DEFINE_integer("num_cpu_devices", 8, "Host devices to make on a CPU-only machine.")
lm_setup.define_harness_flags(["The tests make"])
flags.mark_flags_as_required(["workdir"])
flags.register_validator("workdir", workdir_lib.flag_validator)


def train_teacher(config, workdir: str, tokenizer_path: str) -> str:
  """`config.teacher`'s GPT-2 trained on the docs corpus (`<workdir>/teacher`, resumed or
  skipped when done) and exported with the tokenizer; returns the HF directory."""
  import ml_collections

  from configs import finetune_lm
  from trainer import LanguageModelTrainer
  from trainer.checkpoint import Checkpointer
  from trainer.data import lm
  spec, directory = config.teacher, os.path.join(workdir, "teacher")
  out = os.path.join(directory, "hf")
  teacher = finetune_lm.get_config("full")
  teacher.model.update(vocab_size=config.model.vocab_size, num_layers=spec.num_layers,
                       embed_dim=spec.embed_dim, num_heads=spec.num_heads,
                       mlp_dim=spec.mlp_dim, max_len=config.model.max_len)
  teacher.data = ml_collections.ConfigDict(config.data.to_dict())
  corpus = os.path.join(directory, "docs.jsonl")  # The docs' paragraphs as documents.
  os.makedirs(directory, exist_ok=True)
  with open(corpus, "w") as f:
    for doc in lm_setup.documents(lm_setup.read_text(None)):
      f.write(json.dumps({"text": doc}) + "\n")
  teacher.data.update(sources=(corpus,), eval_sources=(), bad_records="stop")
  teacher.update(num_train_steps=spec.steps, learning_rate=spec.learning_rate,
                 seed=config.seed)
  teacher.checkpoint.every_steps = spec.steps
  # The fine-tune's warmup, within the teacher's run (a run of a few steps has less).
  teacher.schedule.warmup_steps = min(teacher.schedule.warmup_steps, spec.steps - 1)
  checkpointer = Checkpointer.from_config(teacher, directory)
  try:
    if checkpointer.latest_step() != spec.steps:
      trainer = LanguageModelTrainer(teacher)
      trainer.fit(lm.from_config(teacher, trainer.strategy.process_slice(teacher.batch_size)),
                  num_steps=spec.steps, checkpointer=checkpointer)
  finally:
    checkpointer.close()
  workdir_lib.write_config(directory, teacher)
  if not os.path.isfile(os.path.join(out, "config.json")):
    lm_setup.export_with_tokenizer(directory, out, teacher, tokenizer_path)
  return out


def write_records(config, directory: str, teacher_dir: str, tokenizer_path: str
                  ) -> tuple[str, str]:
  """A prompt per docs paragraph and the teacher's sampled completion of it: the train and
  held-out JSONL files (written once)."""
  paths = [os.path.join(directory, f"{name}.jsonl") for name in ("train", "held_out")]
  if all(os.path.isfile(p) for p in paths):
    return paths[0], paths[1]
  import ml_collections
  import numpy as np

  from trainer import LanguageModelTrainer
  from trainer.data.lm import tokenizer_of
  from trainer.generation import Generator, Sampling
  from trainer.interop import hf
  del tokenizer_path
  tokenizer = tokenizer_of(config)  # As the records' pipeline tokenizes (its BOS too).
  spec = config.distill
  prompts = []
  for doc in lm_setup.documents(lm_setup.read_text(None)):
    words = doc.split()
    ids = tokenizer.encode_text(" ".join(words[:8]))
    if len(words) >= 12 and len(ids) <= spec.max_prompt_length:
      prompts.append(" ".join(words[:8]))
  teacher = ml_collections.ConfigDict(config.to_dict())
  del teacher["distill"], teacher["teacher"]
  teacher.trainer = "trainer.language_model:LanguageModelTrainer"
  teacher.model = ml_collections.ConfigDict(hf.model_fields(teacher_dir))
  teacher.init_from.path = teacher_dir
  teacher.lora.update(rank=0, targets=(), base_dtype="")
  teacher.sweep = ml_collections.ConfigDict(config.sweep.to_dict())
  for name in teacher.sweep.grid:
    teacher.sweep.grid[name] = ()
  teacher.update(strategy=ml_collections.ConfigDict(config.strategy.to_dict()))
  teacher.strategy.update(name="single_device")
  trainer = LanguageModelTrainer(teacher)
  tokens = np.zeros((1, 8), np.int32)
  state = trainer.init_state({"inputs": tokens, "targets": tokens})
  ids = [tokenizer.encode_text(p) for p in prompts]
  out = Generator.from_trainer(trainer)(
      state, ids, Sampling(max_new_tokens=spec.max_completion_length,
                           temperature=spec.temperature, stop_tokens=(tokenizer.eos_id,),
                           pad_id=tokenizer.eos_id), seed=config.seed)
  os.makedirs(directory, exist_ok=True)
  with open(paths[0], "w") as train, open(paths[1], "w") as held_out:
    for i, (prompt, new) in enumerate(zip(prompts, out.tokens, strict=True)):
      completion = tokenizer.tokenizer.decode([t for t in new if t != tokenizer.eos_id])
      (held_out if i % 10 == 9 else train).write(
          json.dumps({"prompt": prompt, "completion": completion}) + "\n")
  return paths[0], paths[1]


def prepare(config, workdir: str) -> str:
  """The tokenizer, the teacher, the records and the student's base; returns the
  tokenizer's path."""
  text = lm_setup.read_text(None)
  model_dir = lm_setup.start_model(config, workdir, section="distill")
  _, tokenizer_path = lm_setup.load_tokenizer(text, config.model.vocab_size, model_dir,
                                              workdir, chat=False)
  with config.unlocked():
    config.data.tokenizer = config.data.tokenizer or tokenizer_path
  if not config.distill.teacher:
    teacher = train_teacher(config, workdir, config.data.tokenizer)
    with config.unlocked():
      config.distill.teacher = teacher
  if not config.data.sources:
    train, held_out = write_records(config, os.path.join(workdir, "records"),
                                    config.distill.teacher, config.data.tokenizer)
    with config.unlocked():
      config.data.update(sources=(train,), eval_sources=(held_out,))
  return config.data.tokenizer


def distill(config, workdir: str) -> dict:
  """Distils the teacher into the student (module docstring); returns the held-out metrics
  before and after."""
  from trainer import writers
  from trainer.checkpoint import Checkpointer
  from trainer.distill import DistillationTrainer
  from trainer.distill import data as distill_data
  from trainer.distributed.devices import is_primary

  os.makedirs(workdir, exist_ok=True)
  tokenizer_path = prepare(config, workdir)
  trainer = DistillationTrainer(config)
  held_out = distill_data.eval_batches(config)
  checkpointer = Checkpointer.from_config(config, workdir)
  writer = writers.create_writer(workdir, config.writers, config)
  try:
    fresh = checkpointer.latest_step() is None
    state = trainer.init_state(held_out[0])
    before = trainer.evaluate(state, held_out)
    actions = lm_setup.harness_actions(trainer, writer, tokenizer_path, config.log_every_steps)
    result = trainer.fit(distill_data.from_config(
        config, trainer.strategy.process_slice(config.batch_size)),
        num_steps=config.num_train_steps, checkpointer=checkpointer, writer=writer,
        workdir=workdir, state=state if fresh else None, actions=actions,
        eval_batches=lambda: held_out)
  finally:
    checkpointer.close()
    writer.close()
  after = trainer.evaluate(result.state, held_out)
  if is_primary():
    lm_setup.report_stop(result, config.num_train_steps, workdir)
    print(f"teacher {config.distill.teacher}; {result.step} steps of {config.batch_size} "
          f"prompts, lmbda={config.distill.lmbda} beta={config.distill.beta} "
          f"T={config.distill.temperature}")
    for name in ("reverse_kl", "nll"):
      print(f"held-out {name}: before={before[name]:.4f} after={after[name]:.4f}")
    if trainer.sweep is None:
      out = os.path.join(workdir, "hf")
      lm_setup.export_with_tokenizer(workdir, out, config, tokenizer_path)
      print(f"exported the student to {out}")
  return {"before": before, "after": after}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  from trainer.distributed import devices
  devices.initialize(FLAGS.num_cpu_devices)
  with devices.naming_the_process():
    distill(FLAGS.config, FLAGS.workdir)


if __name__ == "__main__":
  config_lib.run(main)
