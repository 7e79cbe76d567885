r"""Reinforcement learning with verifiable rewards (examples/rl_lm.py).

    python examples/rl_lm.py --workdir=/tmp/rl_addition
    python examples/rl_lm.py --config=configs/rl.py:finetuned --workdir=/tmp/rl_docs \
        --config.init_from.path=/tmp/finetune/hf

`config.rl` holds the loss, the group size, the clipping, the KL and the rewards
(`trainer.rl`); `config.data.sources` name prompt records (`{prompt: ...}`,
`trainer.rl.data`).

Variants: `addition` (a 2-layer transformer from scratch on single-digit sums over a
character vocabulary, the reward 1 for the right digit), `sweep` (`addition` at four
learning rates, one ensemble program: `trainer.sweep`), `finetuned` (an HF model, the
fine-tune example's by default, on prompts of the docs, with LoRA adapters), `tools`
(a table only a `lookup` tool reads, multi-turn rollouts after a supervised warm start:
`examples/tool_tasks.py`) and `reasoning` (a `reasoning_gym` dataset scored by its own
`score_answer`: `examples/reasoning_tasks.py`).
"""

import os

import ml_collections

from configs import base, finetune_lm, lm

#: The example's task file (its prompts and rewards), by absolute path: a run may start in
#: any directory.
TASKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                     "rl_tasks.py")

#: The tool-use task's file (its environment, reward and files).
TOOL_TASKS = os.path.join(os.path.dirname(TASKS), "tool_tasks.py")

#: The reasoning_gym task's file (its records and reward).
REASONING_TASKS = os.path.join(os.path.dirname(TASKS), "reasoning_tasks.py")

VARIANTS = ("addition", "sweep", "finetuned", "tools", "reasoning")


def rl_fields() -> ml_collections.ConfigDict:
  """`config.rl`: the loss, the rollouts and the rewards (TRL 1.16's defaults, but G)."""
  return ml_collections.ConfigDict(dict(
      loss="dapo",  # "grpo", "dr_grpo" or "dapo" (how the tokens' losses are averaged).
      num_generations=16,  # G: completions per prompt (a group).
      num_iterations=1,  # μ: updates on each step's rollouts.
      beta=0.0,  # The KL's weight (0: no reference is held).
      epsilon=0.2,  # The ratio's clip below 1 ...
      epsilon_high=ml_collections.config_dict.placeholder(float),  # ... and above (None: epsilon).
      scale_rewards="group",  # "group": divide by the group's std; "none": Dr. GRPO's.
      reference="auto",  # With beta > 0: "auto" (adapters_off under LoRA, else copy).
      max_prompt_length=16,
      max_completion_length=8,
      temperature=1.0,
      top_k=0,
      top_p=1.0,
      prompt_field="prompt",
      # A record's bytes as JSON, at most: each row carries its whole record, whose other
      # fields the rewards get as keyword arguments (an answer, a test case).
      max_record_bytes=4096,
      # Rows of each train rollout written as a table of sample completions (the text
      # `completions`) every log_every_steps; 0: none.
      log_completions=8,
      # "package.module:function" or "path/to/file.py:function" (trainer.rl.rewards).
      rewards=(),
      reward_weights=(),  # One per reward; empty: 1 each.
      # Multi-turn rollouts (trainer.rl.tools): typed functions the model may call, named as
      # rewards are, and a class built once per rollout (reset(**record), its public
      # methods tools, an optional get_reward()). Either makes the rollout multi-turn.
      tools=(),
      environment="",
      # Tool turns a rollout may take (None: no limit, TRL's default).
      max_tool_calling_iterations=ml_collections.config_dict.placeholder(int),
  ))


def get_config(variant: str = "addition") -> ml_collections.ConfigDict:
  if variant not in VARIANTS:
    raise ValueError(f"configs/rl.py:{variant}: the variant must be one of {VARIANTS}.")
  if variant == "finetuned":
    config = finetune_lm.get_config("lora")
    config.rl = rl_fields()
    # The docs' prompts that tokenize past the row are skipped and counted, not fatal.
    config.data.bad_records = "skip"
    config.rl.update(max_prompt_length=32, max_completion_length=16, num_generations=4,
                     rewards=(f"{TASKS}:mentions_training",))
    config.batch_size = 8  # Prompts: a multiple of the 8 data replicas on 8 host devices.
    config.learning_rate = 3e-3  # LoRA's rate (the fine-tune's own `lora` variant's).
  else:
    config = base.get_config()
    config.model = ml_collections.ConfigDict(dict(
        family="transformer", vocab_size=16, num_layers=2, embed_dim=64, num_heads=4,
        head_dim=16, mlp_dim=256, max_len=8, vocab_multiple=None, **lm.family_fields()))
    config.data = lm.corpus_fields()
    config.rl = rl_fields()
    # G = 32: with 16 a group often holds one answer only (its advantages are all 0) and
    # the mean reward stalls below 0.9 on some seeds; with 4 it stalls far lower.
    config.rl.update(max_prompt_length=5, max_completion_length=1, num_generations=32,
                     rewards=(f"{TASKS}:correct_sum",))
    config.seq_len = 8
    config.batch_size = 32
    config.optimizer = "adam"
    config.learning_rate = 1e-3
    config.strategy.name = "single_device"
  config.trainer = "trainer.rl:RLTrainer"
  config.eval_batch_size = 8
  config.num_train_steps = 400
  config.log_every_steps = 20
  config.eval_every_steps = 0
  # Decayed to 0 over the run: at a constant rate Adam's late updates, normalised from the
  # few groups still holding two answers, undo what was learnt.
  config.schedule.name = "cosine"
  config.schedule.warmup_steps = 0
  config.checkpoint.every_steps = 0
  if variant == "tools":  # A table only a tool reads (examples/tool_tasks.py).
    config.model.update(max_len=192, vocab_size=64)  # The warm start packs 4 a row.
    config.rl.update(max_prompt_length=32, max_completion_length=32, num_generations=8,
                     environment=f"{TOOL_TASKS}:Table", rewards=(f"{TOOL_TASKS}:correct_value",),
                     max_tool_calling_iterations=2, log_completions=4)
    config.batch_size = 8
    config.num_train_steps = 60
    config.log_every_steps = 10
    # A supervised warm start on whole demonstrated conversations (a call, its result, the
    # answer) before RL, as tool-use RL starts in practice; its checkpoint is the policy's
    # config.init_from (the example writes both).
    config.warm_start = ml_collections.ConfigDict(dict(
        steps=400, demonstrations=4000, learning_rate=1e-2, seq_len=192))
  if variant == "reasoning":  # A reasoning_gym dataset, scored by its own score_answer.
    config.model.update(max_len=48, vocab_size=104)
    config.rl.update(max_prompt_length=40, max_completion_length=4, num_generations=16,
                     rewards=(f"{REASONING_TASKS}:score_answer",), log_completions=4)
    config.batch_size = 16
    config.num_train_steps = 100
    # The dataset the example generates (examples/reasoning_tasks.py): its name, sizes and
    # settings (reasoning_gym.create_dataset's keyword arguments).
    config.reasoning = ml_collections.ConfigDict(dict(
        dataset="basic_arithmetic", size=400, held_out=32, settings=dict(
            min_terms=2, max_terms=2, min_digits=1, max_digits=1, operators=("+",))))
  if variant == "sweep":  # Members over the 'ensemble' axis, each one's prompts over 'data'.
    config.strategy.name = "sharded_ensemble"
    config.strategy.logical_axis_rules = ()
    config.ensemble_size = 0  # The sweep's member count.
    config.strategy.ensemble_mesh_shape = (4, -1)
    config.sweep.grid.learning_rate = (3e-4, 1e-3, 3e-3, 1e-2)
    config.sweep.metric = "reward"  # Held-out prompts' mean reward, compared at each eval.
    config.sweep.mode = "max"
    config.eval_every_steps = 100
  return config
