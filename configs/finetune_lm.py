r"""Fine-tuning a Hugging Face-format language model on a text file (examples/finetune_lm.py).

    python examples/finetune_lm.py --workdir=/tmp/finetune
    python examples/finetune_lm.py --config=configs/finetune_lm.py:lora --workdir=/tmp/lora

`config.init_from.path` names the pretrained model: an HF directory (`config.json` +
`model.safetensors`, or the sharded index form) of a family with a mapping (`gpt2`,
`llama`, `mistral`, `qwen2`, `qwen3`, `mixtral`, `qwen3_moe`:
`trainer.interop.families.FAMILIES`); `config.model` is then read from its `config.json`.
Empty, the example writes a small randomly initialised GPT-2 in HF format
into the workdir and starts from that.

Variants: `full` (every weight trains, FSDP over the devices), `lora` (rank-8
adapters on the attention and MLP kernels, everything else frozen), `qlora` (`lora`
with the frozen base stored in NF4, data parallel) and `instruct`
(`full` on prompt and response pairs rendered with the chat template, the loss on the
responses: `config.data.chat`), and `lora_sweep` (`lora` over 16 learning rates as one
`sharded_ensemble` program: 16 adapters over one copy of the frozen base,
`trainer.run.shared`), for any of them (`--config.model.family=llama` makes
the local base model a Llama).
"""

import ml_collections

from configs import base, lm

VARIANTS = ("full", "lora", "qlora", "instruct", "lora_sweep")


def get_config(variant: str = "full") -> ml_collections.ConfigDict:
  if variant not in VARIANTS:
    raise ValueError(f"configs/finetune_lm.py:{variant}: the variant must be one of "
                     f"{VARIANTS}.")
  config = base.get_config()
  config.trainer = "trainer.language_model:LanguageModelTrainer"
  # The local base model when init_from.path is empty: a GPT-2 (or, by flag,
  # --config.model.family=llama, mistral, qwen2 or qwen3); each family's own fields are
  # declared None (its default) as in configs/lm.py; the vocabulary is the tokenizer's.
  config.model = ml_collections.ConfigDict(dict(
      family="gpt2", vocab_size=512, num_layers=2, embed_dim=64, num_heads=4,
      head_dim=ml_collections.config_dict.placeholder(int), mlp_dim=256, max_len=128,
      **lm.family_fields()))
  config.seq_len = 64
  config.batch_size = 16
  config.eval_batch_size = 16
  config.num_train_steps = 200
  config.log_every_steps = 50
  config.eval_every_steps = 0  # The example evaluates before and after.
  config.optimizer = "adamw"
  config.learning_rate = 1e-3
  config.weight_decay = 0.01
  config.schedule.name = "cosine"
  config.schedule.warmup_steps = 10
  config.checkpoint.every_steps = 0  # Saved at the end (and on a stop).
  config.data = lm.corpus_fields()

  # FSDP: weights and optimizer state sharded over the data axis (configs/lm.py's rules).
  config.strategy.name = "sharded_data_parallel"
  config.strategy.mesh_shape = (-1,)
  config.strategy.mesh_axes = ("data",)
  config.strategy.logical_axis_rules = lm.rules(embed="data")
  if variant in ("lora", "qlora", "lora_sweep"):
    config.lora.rank = 8
    config.lora.alpha = 16.0
    # Every attention and MLP kernel, in each family's names (GPT-2's attn/c_attn,
    # attn/c_proj, mlp/c_fc, mlp/c_proj; Llama's self_attn/{q,k,v,o}_proj, mlp/*_proj).
    config.lora.targets = (".*attn/[^/]*/kernel", ".*mlp/[^/]*/kernel")
    config.learning_rate = 3e-3
  if variant == "qlora":  # The frozen base in NF4, a scale per 16 inputs (the heads' width).
    config.lora.base_dtype = "nf4"
    config.lora.block_size = 16
    # Data parallel: the 4-bit base whole on each device (FSDP would split `embed`'s 4
    # blocks of 16 over the devices, which 8 do not divide).
    config.strategy.logical_axis_rules = lm.rules()
  if variant == "lora_sweep":  # 16 members, 2 a device on 8, each its own adapters.
    config.strategy.update(name="sharded_ensemble", mesh_shape=(), mesh_axes=(),
                           logical_axis_rules=(), ensemble_mesh_shape=(-1, 1))
    config.ensemble_size = 0
    config.sweep.grid.learning_rate = tuple(3e-4 * 10 ** (i / 7.5) for i in range(16))
  if variant == "instruct":  # Prompt/response pairs in the chat template; responses trained.
    config.data.chat = True
  return config
