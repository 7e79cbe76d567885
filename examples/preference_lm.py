r"""Aligns a Hugging Face-format language model with preference pairs (DPO, IPO, SimPO, ORPO).

    python examples/preference_lm.py --workdir=/tmp/dpo
    python examples/preference_lm.py --workdir=/tmp/dpo \
        --config.init_from.path=/tmp/finetune/hf --pairs=pairs.jsonl

- The model: `--config.init_from.path` names an HF model directory (the fine-tune
  example's export, `<its workdir>/hf`, or a published model of one of the seven
  families); its `config.json` sets `config.model`. Without one, a small randomly
  initialised GPT-2 is written in HF format to `<workdir>/base` first, as the fine-tune
  example does.
- The tokenizer: the model directory's `tokenizer.json`, else one trained on the text.
- The pairs: `--pairs` (JSONL or Parquet files of `{prompt, chosen, rejected}` records,
  text or chat), or else the example writes its own, offline, into `<workdir>/pairs`:
  from the paragraphs of a fixed text of its own (`practice_text`, or `--text` files), a
  prompt (a paragraph's opening words), the chosen response (the words that follow) and
  the rejected one (the same words in reverse order); every tenth held out.
- The loss and reference: `configs/preference.py:<variant>` (`dpo`, `ipo`, `simpo`,
  `orpo`, `lora`, `qlora`) and `config.preference` (`trainer.preference`).

It prints the held-out reward accuracy and margin before and after training and exports
the result as an HF model (`<workdir>/hf`), which
`transformers.AutoModelForCausalLM.from_pretrained` loads. With `--harness_tasks` it runs
lm-evaluation-harness tasks on the policy during training (`trainer.harness.HarnessEval`).
"""

import json
import os
import sys

from absl import app, flags, logging

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lm_setup  # noqa: E402  (the base model, the text and the tokenizer: finetune_lm's)

from trainer import config as config_lib  # noqa: E402  (no jax: safe before devices)
from trainer.run import workdir as workdir_lib  # noqa: E402

FLAGS = flags.FLAGS
config_lib.define_config_file(os.path.join(lm_setup.ROOT, "configs", "preference.py"),
                              "Preference configuration (configs/preference.py:<variant>).")
flags.DEFINE_string("workdir", None, "Directory for the base model, the pairs, checkpoints, "
                    "metrics and the export.")
flags.DEFINE_list("pairs", None, "Preference files (JSONL or Parquet, globs): {prompt, "
                  "chosen, rejected} records; default: pairs written from --text.")
flags.DEFINE_list("text", None, "Text files (globs) the default pairs are made of; default: "
                  "the example's own text (practice_text).")
flags.DEFINE_integer("num_cpu_devices", 8, "Host devices to make on a CPU-only machine.")
lm_setup.define_harness_flags(["The tests make"])
flags.mark_flags_as_required(["workdir"])
flags.register_validator("workdir", workdir_lib.flag_validator)


#: The example's own text: sentences of these parts in their usual order, so that the
#: chosen (the words in order) and the rejected (reversed) responses differ in a way a
#: small model learns. Fixed, so a run prints the same figures whatever else changes.
SUBJECTS = ("the miller", "a young fox", "the old baker", "my sister", "the river guard",
            "a tired sailor", "the village cat", "our teacher", "the tall farmer",
            "a quiet child", "the night watchman", "an old fisherman")
VERBS = ("carried", "painted", "found", "watched", "mended", "counted", "sold", "hid",
         "cleaned", "opened", "lifted", "followed")
OBJECTS = ("a wooden box", "the blue lantern", "three ripe pears", "the broken fence",
           "a heavy sack of flour", "the small red boat", "an empty basket",
           "the green kite", "two silver keys", "the long ladder", "a bundle of letters",
           "the iron gate")
PLACES = ("near the mill", "by the harbour", "under the stone bridge", "in the orchard",
          "at the market", "behind the church", "along the river", "on the hill")
TIMES = ("before dawn", "after the rain", "every spring", "late at night",
         "on market day", "in the cold morning", "before the storm came")


def practice_text(paragraphs: int = 200, seed: int = 0) -> str:
  """`paragraphs` paragraphs of two sentences each (`SUBJECTS` ... `TIMES`), drawn by a
  seeded `random.Random`: the same text on every machine and Python 3 version."""
  import random
  rng = random.Random(seed)

  def sentence() -> str:
    words = " ".join(rng.choice(part) for part in (SUBJECTS, VERBS, OBJECTS, PLACES, TIMES))
    return words[0].upper() + words[1:] + "."

  return "\n\n".join(f"{sentence()} {sentence()}" for _ in range(paragraphs))


def write_pairs(text: str, directory: str) -> tuple[str, str]:
  """Pairs of the text's paragraphs as JSONL (every tenth held out): the prompt a
  paragraph's first 8 words, the chosen response the next 12, the rejected one those 12
  reversed (paragraphs of fewer words, or whose 20 words run past 160 characters, such
  as a command line, are left out). Returns (train, held-out)."""
  os.makedirs(directory, exist_ok=True)
  paths = [os.path.join(directory, f"{name}.jsonl") for name in ("train", "valid")]
  with open(paths[0], "w") as train, open(paths[1], "w") as valid:
    for i, doc in enumerate(lm_setup.documents(text)):
      words = doc.split()
      if len(words) < 20 or len(" ".join(words[:20])) > 160:
        continue
      response = words[8:20]
      record = {"prompt": " ".join(words[:8]), "chosen": " " + " ".join(response),
                "rejected": " " + " ".join(response[::-1])}
      (valid if i % 10 == 0 else train).write(json.dumps(record) + "\n")
  return paths[0], paths[1]


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  from trainer.distributed import devices
  devices.initialize(FLAGS.num_cpu_devices)
  with devices.naming_the_process():
    align(FLAGS.config, FLAGS.workdir)


def held_out_rewards(trainer, state, held_out) -> dict[str, float]:
  values = trainer.evaluate(state, held_out)
  return {k: float(values[k]) for k in ("loss", "rewards/accuracies", "rewards/margins")}


def align(config, workdir: str) -> None:


  from trainer import writers
  from trainer.checkpoint import Checkpointer
  from trainer.distributed.devices import is_primary
  from trainer.preference import PreferenceTrainer
  from trainer.preference import data as pdata

  os.makedirs(workdir, exist_ok=True)
  text = ""
  if not (FLAGS.pairs or config.data.sources):
    text = lm_setup.read_text(FLAGS.text) if FLAGS.text else practice_text()
  model_dir = lm_setup.start_model(config, workdir, "preference")
  _, tokenizer_path = lm_setup.load_tokenizer(text or "\n", config.model.vocab_size, model_dir,
                                              workdir, chat=False)
  with config.unlocked():
    config.data.tokenizer = tokenizer_path
    if FLAGS.pairs:
      config.data.sources = (",".join(FLAGS.pairs),)
    elif not config.data.sources:
      train_file, held_file = write_pairs(text, os.path.join(workdir, "pairs"))
      config.data.sources, config.data.eval_sources = (train_file,), (held_file,)

  trainer = PreferenceTrainer(config)
  stream = pdata.from_config(config, trainer.strategy.process_slice(config.batch_size))
  held_out = pdata.eval_batches(config)
  checkpointer = Checkpointer.from_config(config, workdir)
  writer = writers.create_writer(workdir, config.writers, config)
  try:
    fresh = checkpointer.latest_step() is None
    state = trainer.init_state(next(stream()))
    # Under reference="precomputed" the reference's log-probs of every pair, from this
    # state (read back from the workdir on a resume).
    stream, held_out = trainer.precompute_reference(
        state, stream, num_steps=config.num_train_steps, workdir=workdir,
        eval_batches=held_out)
    before = held_out_rewards(trainer, state, held_out) if held_out else None
    from trainer.data.corpus_metrics import CorpusMetrics
    actions = [CorpusMetrics(writer, every_steps=config.log_every_steps)]
    # Benchmark tasks on the training state (trainer.harness), with --harness_tasks.
    actions += lm_setup.harness_actions(trainer, writer, tokenizer_path, config.log_every_steps)
    # Evaluated at config.eval_every_steps and at the end: a sweep's report compares its
    # members there (config.sweep.metric) and exports the best to <workdir>/sweep_best.
    result = trainer.fit(stream, num_steps=config.num_train_steps, checkpointer=checkpointer,
                         writer=writer, workdir=workdir, state=state if fresh else None,
                         actions=actions, eval_batches=(lambda: held_out) if held_out else None)
  finally:
    checkpointer.close()
    writer.close()
  after = held_out_rewards(trainer, result.state, held_out) if held_out else None
  if not is_primary():
    return
  lm_setup.report_stop(result, config.num_train_steps, workdir)
  if before is not None:
    print(f"held-out pairs ({config.preference.loss}): reward accuracy "
          f"{before['rewards/accuracies']:.3f} -> {after['rewards/accuracies']:.3f}, margin "
          f"{before['rewards/margins']:.4f} -> {after['rewards/margins']:.4f}, loss "
          f"{before['loss']:.4f} -> {after['loss']:.4f} "
          f"({result.step} steps of {config.batch_size} pairs"
          f"{', the members mean' if trainer.sweep is not None else ''})")
  out = os.path.join(workdir, "hf")
  source = workdir  # A sweep's best member, a single-model checkpoint of its own.
  if trainer.sweep is not None:
    source = os.path.join(workdir, "sweep_best")
    with open(os.path.join(workdir, "sweep_best_config.json")) as f:
      print(f"sweep: best beta={json.load(f)['preference']['beta']:g} by held-out "
            f"{config.sweep.metric}{lm_setup.sweep_ties(workdir)}")
  names = lm_setup.export_with_tokenizer(source, out, config, tokenizer_path)
  logging.info("exported %d tensors", len(names))
  print(f"exported to {out} (config.json, model.safetensors, tokenizer.json)")


if __name__ == "__main__":
  config_lib.run(main)
