r"""Reinforcement learning with verifiable rewards (GRPO, Dr. GRPO, DAPO) on a language model.

    python examples/rl_lm.py --workdir=/tmp/rl_addition
    python examples/rl_lm.py --config=configs/rl.py:finetuned --workdir=/tmp/rl_docs \
        --config.init_from.path=/tmp/finetune/hf

- `addition` (the default variant): a 2-layer transformer from scratch learns
  single-digit sums (`"3+4="` -> `"7"`) from a reward of 1 for the right digit, over a
  character vocabulary the example writes with the 55 prompts into `<workdir>/task`
  (offline, `examples/rl_tasks.py`). It starts near chance (0.1); at G = 32 completions
  per prompt its mean reward passes 0.9 by about step 300 of the config's 400.
- `sweep`: `addition` at four learning rates, the members one ensemble program
  (`trainer.sweep`): each member's rollouts from its own parameters; the example prints
  each member's held-out reward and the best learning rate (`<workdir>/sweep_best`).
- `finetuned`: an HF model (`--config.init_from.path`, e.g. the fine-tune example's
  export; without one, a random GPT-2 written to `<workdir>/base`) with LoRA adapters,
  on prompts of this repository's docs (a paragraph's opening words; every tenth held
  out), rewarded for mentioning training (`rl_tasks.mentions_training`).
- `tools`: multi-turn rollouts with an environment (`examples/tool_tasks.py`): a table
  whose values each rollout draws from its seed, read only by a `lookup` tool. The example
  first trains the model on demonstrated conversations (`config.warm_start`, checkpointed
  in `<workdir>/warm_start`, the policy's `config.init_from`), then runs RL.
- `reasoning`: a `reasoning_gym` dataset (the `reasoning` extra) as prompt records,
  scored by the dataset's own `score_answer` (`examples/reasoning_tasks.py`).

Each step draws `config.rl.num_generations` completions per prompt with the project's
`Generator` inside the train step, from the current parameters (`trainer.rl`). The
example prints the held-out prompts' mean reward (one sampled completion each) before and
after training, and exports the policy as an HF model (`<workdir>/hf`) when the model is
of an HF family. With `--harness_tasks` it runs lm-evaluation-harness tasks during
training (`trainer.harness.HarnessEval`).
"""

import json
import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # rl_tasks: the rewards.

import lm_setup  # noqa: E402
import reasoning_tasks  # noqa: E402
import rl_tasks  # noqa: E402
import tool_tasks  # noqa: E402

from trainer import config as config_lib  # noqa: E402  (no jax: safe before devices)
from trainer.run import workdir as workdir_lib  # noqa: E402

FLAGS = flags.FLAGS
config_lib.define_config_file(os.path.join(lm_setup.ROOT, "configs", "rl.py"),
                              "RL configuration (configs/rl.py:<variant>).")
flags.DEFINE_string("workdir", None, "Directory for the task's files, checkpoints, metrics "
                    "and the export.")
flags.DEFINE_integer("num_cpu_devices", 8, "Host devices to make on a CPU-only machine.")
lm_setup.define_harness_flags(["The tests make"])
flags.mark_flags_as_required(["workdir"])
flags.register_validator("workdir", workdir_lib.flag_validator)


def docs_prompts(directory: str, tokenizer_path: str, max_tokens: int) -> tuple[str, str]:
  """A prompt per docs paragraph of 12 words or more: its first 8 words, where they fit
  in `max_tokens` of the run's tokenizer (`config.rl.max_prompt_length`); every tenth
  held out. Returns the train and held-out JSONL files."""
  from trainer.data.corpus import Tokenizer
  tokenizer = Tokenizer(tokenizer_path)
  os.makedirs(directory, exist_ok=True)
  paths = [os.path.join(directory, f"{name}.jsonl") for name in ("prompts", "held_out")]
  kept = 0
  with open(paths[0], "w") as train, open(paths[1], "w") as held_out:
    for doc in lm_setup.documents(lm_setup.read_text(None)):
      words = doc.split()
      prompt = " ".join(words[:8])
      if len(words) >= 12 and len(tokenizer.encode_text(prompt)) <= max_tokens:
        (held_out if kept % 10 == 9 else train).write(json.dumps({"prompt": prompt}) + "\n")
        kept += 1
  return paths[0], paths[1]


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  from trainer.distributed import devices
  devices.initialize(FLAGS.num_cpu_devices)
  with devices.naming_the_process():
    train(FLAGS.config, FLAGS.workdir)


def warm_start(config, demonstrations: str, workdir: str) -> None:
  """`config.warm_start.steps` of supervised training on whole demonstrated conversations
  (the LM's loss on every token), checkpointed in `workdir`: the policy's starting point.
  A finished warm start is not run again."""
  from trainer import LanguageModelTrainer
  from trainer.checkpoint import Checkpointer
  from trainer.data import lm

  warm = config.warm_start
  sft = config.copy_and_resolve_references()
  with sft.unlocked():
    sft.data.update(sources=(demonstrations,), eval_sources=())
    sft.update(seq_len=warm.seq_len, learning_rate=warm.learning_rate,
               num_train_steps=warm.steps, eval_every_steps=0)
    sft.checkpoint.every_steps = warm.steps
  checkpointer = Checkpointer.from_config(sft, workdir)
  try:
    if checkpointer.latest_step() == warm.steps:
      return
    trainer = LanguageModelTrainer(sft)
    trainer.fit(lm.from_config(sft, trainer.strategy.process_slice(sft.batch_size)),
                num_steps=warm.steps, checkpointer=checkpointer)
  finally:
    checkpointer.close()


def prepare(config, workdir: str) -> str:
  """The task's files and model (see the module docstring); returns the tokenizer path."""

  if "reasoning" in config:  # A reasoning_gym dataset, written as records.
    spec = config.reasoning
    tokenizer_path, train, held_out = reasoning_tasks.write_task(
        os.path.join(workdir, "task"), spec.dataset, size=spec.size, seed=config.seed,
        held_out=spec.held_out, **spec.settings.to_dict())
    with config.unlocked():
      config.data.tokenizer = config.data.tokenizer or tokenizer_path
      config.data.sources = config.data.sources or (train,)
      config.data.eval_sources = config.data.eval_sources or (held_out,)
    return config.data.tokenizer
  if "warm_start" in config:  # tools: the table task, and the warm start's checkpoint.
    tokenizer_path, prompts, demonstrations = tool_tasks.write_task(
        os.path.join(workdir, "task"), demonstrations=config.warm_start.demonstrations,
        seed=config.seed)
    with config.unlocked():
      config.data.tokenizer = config.data.tokenizer or tokenizer_path
      config.data.sources = config.data.sources or (prompts,)
      config.data.eval_sources = config.data.eval_sources or (prompts,)
    if not config.init_from.path and config.warm_start.steps:
      warm_start(config, demonstrations, os.path.join(workdir, "warm_start"))
      with config.unlocked():
        config.init_from.path = os.path.join(workdir, "warm_start")
    return config.data.tokenizer
  if config.model.family == "transformer" and not config.init_from.path:  # addition
    prompts, tokenizer_path = rl_tasks.write_addition(os.path.join(workdir, "task"))
    with config.unlocked():
      config.data.tokenizer = config.data.tokenizer or tokenizer_path
      config.data.sources = config.data.sources or (prompts,)
      config.data.eval_sources = config.data.eval_sources or (prompts,)
    return config.data.tokenizer
  model_dir = lm_setup.start_model(config, workdir, "rl")
  text = lm_setup.read_text(None)
  _, tokenizer_path = lm_setup.load_tokenizer(text, config.model.vocab_size, model_dir,
                                              workdir, chat=False)
  with config.unlocked():
    config.data.tokenizer = tokenizer_path
    if not config.data.sources:
      prompts, held_out = docs_prompts(os.path.join(workdir, "task"), tokenizer_path,
                                       config.rl.max_prompt_length)
      config.data.sources, config.data.eval_sources = (prompts,), (held_out,)
  return tokenizer_path


def train(config, workdir: str) -> None:
  from trainer import writers
  from trainer.checkpoint import Checkpointer
  from trainer.distributed.devices import is_primary
  from trainer.interop import families
  from trainer.rl import RLTrainer
  from trainer.rl import data as rl_data

  os.makedirs(workdir, exist_ok=True)
  tokenizer_path = prepare(config, workdir)
  trainer = RLTrainer(config)
  stream = rl_data.from_config(config, trainer.strategy.process_slice(config.batch_size))
  held_out = rl_data.eval_batches(config)
  checkpointer = Checkpointer.from_config(config, workdir)
  writer = writers.create_writer(workdir, config.writers, config)
  try:
    fresh = checkpointer.latest_step() is None
    state = trainer.init_state(next(stream()))
    before = trainer.evaluate(state, held_out)["reward"]
    from trainer.data.corpus_metrics import CorpusMetrics  # Skipped prompts, counted.
    actions = [CorpusMetrics(writer, every_steps=config.log_every_steps)]
    actions += lm_setup.harness_actions(trainer, writer, tokenizer_path,
                                        config.log_every_steps,
                                        max_new_tokens=config.rl.max_completion_length)
    # A sweep's report compares its members' held-out reward at each evaluation
    # (config.sweep.metric) and exports the best to <workdir>/sweep_best.
    result = trainer.fit(stream, num_steps=config.num_train_steps, checkpointer=checkpointer,
                         writer=writer, workdir=workdir, state=state if fresh else None,
                         actions=actions, eval_batches=(
                             (lambda: held_out) if trainer.sweep is not None else None))
  finally:
    checkpointer.close()
    writer.close()
  after = trainer.evaluate(result.state, held_out)["reward"]
  if not is_primary():
    return
  lm_setup.report_stop(result, config.num_train_steps, workdir)
  print(f"held-out mean reward: before={before:.3f} after={after:.3f} "
        f"({result.step} steps of {config.batch_size} prompts x "
        f"{config.rl.num_generations} completions, {config.rl.loss}"
        f"{', the members mean' if trainer.sweep is not None else ''})")
  if trainer.sweep is not None:
    for i, values in enumerate(trainer.evaluator.evaluate_members(result.state, held_out)):
      print(f"member {trainer.sweep.label(i)}: held-out mean reward {values['reward']:.3f}")
    with open(os.path.join(workdir, "sweep_best_config.json")) as f:
      print(f"sweep: best learning_rate={json.load(f)['learning_rate']:g} by held-out "
            f"{config.sweep.metric}{lm_setup.sweep_ties(workdir)}")
  if config.model.family in families.FAMILIES:
    out = os.path.join(workdir, "hf")
    lm_setup.export_with_tokenizer(workdir, out, config, tokenizer_path)
    print(f"exported to {out} (config.json, model.safetensors, tokenizer.json)")


if __name__ == "__main__":
  config_lib.run(main)
