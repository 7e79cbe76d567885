r"""A small decoder-only transformer LM under one of five layouts, chosen by the config string.

    python examples/transformer_lm.py --config=configs/lm.py:fsdp --workdir=/tmp/lm

Layouts (all `sharded_data_parallel`; only the mesh and the rule table change):

- `data_parallel`: batch over `data`; weights replicated.
- `fsdp`: also `embed -> data`: every weight and its optimizer state is
  sharded over the data axis and gathered per layer when used.
- `tensor_parallel`: `heads`, `mlp`, `vocab -> model` over all devices.
- `data_tensor`: a 2 x (devices/2) mesh, batch over `data`, tensor parallel
  over `model`.
- `fsdp_tensor`: `data_tensor` plus `embed -> data`.

Pipeline layouts (`strategies/pipeline.py`): a `stage` mesh axis and the rule
`layer -> stage` put the decoder blocks' stages on their own devices; the batch
runs through them in `config.strategy.pipeline.microbatches` pieces.

- `pipeline`: 2 data x 4 stages, GPipe, 4 layers, 8 microbatches.
- `pipeline_circular`: 2 data x 4 stages, circular with 2 repeats (8 layers: stage
  `s` holds layers `s` and `s + 4`), 8 microbatches.
- `pipeline_fsdp`: `pipeline` with `embed -> data` (weights sharded within a stage).
- `pipeline_tensor`: 2 data x 2 stages x 2 model, tensor parallel within a stage.

Context layouts (`strategies/context.py`): a `context` mesh axis and the rule
`length -> context` split every sequence over it; attention (`models.attention`)
gathers keys and values over it, or passes them round a ring
(`config.strategy.context.method`).

- `context`: the whole mesh on `context` (1 data x 8 context), all-gather attention.
- `context_ring`: `context` with ring attention.
- `data_context`: 2 data x 4 context.
- `context_tensor`: 2 context x 4 model, tensor parallel over heads.
- `context_fsdp`: 2 data x 4 context, weights sharded over `data` (`embed -> data`).

Expert layouts (`strategies/expert.py`), for a mixture of experts
(`--config.model.num_experts=8`, `models/moe.py`): an `expert` mesh axis and the rule
`expert -> expert` split the experts over it, the batch split over it too; tokens reach
their experts' devices by all-to-all.

A layout of these makes the model a mixture of 8 experts unless `num_experts` is set.

- `expert`: the whole mesh on `expert` (8 experts: one per device).
- `data_expert`: 2 data x 4 expert.
- `expert_tensor`: 2 expert x 4 model, each expert's MLP split over `model`.
- `expert_fsdp`: `data_expert` with `embed -> data` (each expert's weights sharded over
  `data`).
"""

import ml_collections

from configs import base

#: The logical names the LMs' weights carry (`layer` from the layer stack; `kv_heads`:
#: the Llama family's key/value heads, fewer than its query heads).
NAMES = ("vocab", "embed", "heads", "kv", "mlp", "length", "layer", "kv_heads", "expert")


def rules(batch="data", **mapped: str) -> tuple:
  """A rule table with a rule for every logical name: the batch over `batch`, the names
  in `mapped` on their mesh axis, the others replicated (`None`) on purpose."""
  return (("batch", batch),) + tuple((name, mapped.get(name)) for name in NAMES)


def family_fields() -> dict:
  """The fields only some families have, None (the family's module default) unless set, and
  typed, so that a flag sets them (`--config.model.num_kv_heads=2`): llama's key/value
  heads, RMSNorm epsilon, rope base and tied head; gpt2's LayerNorm epsilon and dropout. A
  family refuses a field it does not have that is set; an export writes the value each
  computed with."""
  placeholder = ml_collections.config_dict.placeholder
  return dict(num_kv_heads=placeholder(int), rms_norm_eps=placeholder(float),
              rope_theta=placeholder(float), tie_word_embeddings=placeholder(bool),
              layer_norm_epsilon=placeholder(float), dropout_rate=placeholder(float))


def __getattr__(name: str):
  if name == "FAMILY_FIELDS":  # A function now: each config gets its own typed references.
    return family_fields()
  raise AttributeError(f"module 'configs.lm' has no attribute {name!r}")


def moe_fields() -> dict:
  """A mixture of experts' fields (`models/moe.py`), unset (a dense model) but typed, so a
  flag sets them: `--config.model.num_experts=8 --config.model.capacity_factor=1.25`."""
  placeholder = ml_collections.config_dict.placeholder
  return dict(num_experts=placeholder(int), num_experts_per_tok=placeholder(int),
              capacity_factor=placeholder(float))

_TENSOR = dict(heads="model", mlp="model", vocab="model")
_BY_EXPERT = ("data", "expert")  # The batch over both: each expert device routes its rows.
LAYOUTS = {
    #           mesh_shape, mesh_axes, rules
    "data_parallel": ((-1,), ("data",), (("batch", "data"),)),
    "fsdp": ((-1,), ("data",), rules(embed="data")),
    "tensor_parallel": ((1, -1), ("data", "model"), rules(**_TENSOR)),
    "data_tensor": ((2, -1), ("data", "model"), rules(**_TENSOR)),
    "fsdp_tensor": ((2, -1), ("data", "model"), rules(embed="data", **_TENSOR)),
    "pipeline": ((2, -1), ("data", "stage"), rules(layer="stage")),
    "pipeline_circular": ((2, -1), ("data", "stage"), rules(layer="stage")),
    "pipeline_fsdp": ((2, -1), ("data", "stage"), rules(layer="stage", embed="data")),
    "pipeline_tensor": ((2, 2, -1), ("data", "stage", "model"),
                        rules(layer="stage", **_TENSOR)),
    "context": ((1, -1), ("data", "context"), rules(length="context")),
    "context_ring": ((1, -1), ("data", "context"), rules(length="context")),
    "data_context": ((2, -1), ("data", "context"), rules(length="context")),
    "context_tensor": ((1, 2, -1), ("data", "context", "model"),
                       rules(length="context", **_TENSOR)),
    "context_fsdp": ((2, -1), ("data", "context"), rules(length="context", embed="data")),
    "expert": ((-1,), ("expert",), rules("expert", expert="expert")),
    "data_expert": ((2, -1), ("data", "expert"), rules(_BY_EXPERT, expert="expert")),
    "expert_tensor": ((2, -1), ("expert", "model"),
                      rules("expert", expert="expert", **_TENSOR)),
    "expert_fsdp": ((2, -1), ("data", "expert"),
                    rules(_BY_EXPERT, expert="expert", embed="data")),
}
#: The expert layouts: an MoE model of 8 experts by default (`config.model.num_experts`).
EXPERT_LAYOUTS = ("expert", "data_expert", "expert_tensor", "expert_fsdp")
#: The context layouts' `config.strategy.context` fields.
CONTEXTS = {"context_ring": dict(method="ring")}
#: The pipeline layouts' layers and `config.strategy.pipeline` fields.
PIPELINES = {
    "pipeline": dict(num_layers=4, microbatches=8),
    "pipeline_circular": dict(num_layers=8, microbatches=8, repeats=2),
    "pipeline_fsdp": dict(num_layers=4, microbatches=8),
    "pipeline_tensor": dict(num_layers=4, microbatches=4),
}


def corpus_fields() -> ml_collections.ConfigDict:
  """`config.data`: the text the LM trains on (`trainer.data.lm`). No sources: the
  synthetic token stream (`trainer.language_model.synthetic_token_batches`)."""
  return ml_collections.ConfigDict(dict(
      # One entry per source: paths, globs or directories of .jsonl, .jsonl.gz, .parquet or
      # .array_record files, comma-separated, or tfds:<name>[@<data_dir>]:<split>:
      # --config.data.sources='("corpus/*.jsonl.gz",)'.
      sources=(),
      weights=(),  # One per source (its share of rows); empty: equal.
      text_field="text",  # The JSON key or Parquet column that holds a document.
      text_fields=(),  # One per source, as weights (a JSONL `text`, a Parquet `content`).
      # A tokenizer.json or a model directory; "": config.init_from.path's.
      tokenizer="",
      add_bos=ml_collections.FieldReference(None, field_type=bool),  # None: as the model says.
      add_eos=ml_collections.FieldReference(None, field_type=bool),  # None: when it has one.
      layout="packed",  # "packed" (documents kept apart) or "chunked" (cut, no padding).
      lanes=0,  # Independent row streams; processes must divide it. 0: <= 8, divides batch.
      # Grain worker processes that read, tokenize and pack the lanes ahead of the step
      # (dividing each process's lanes; 0: in the training process), each keeping
      # worker_buffer blocks ready.
      workers=1,
      worker_buffer=2,
      bad_records="stop",  # "stop" naming the file and line, or "skip" and count.
      shuffle_files=True,  # Each lane's file order drawn per epoch from config.seed.
      # Instruction data: each JSONL record a `messages` list or `prompt` and `response`
      # fields, rendered with the model's chat template; the loss covers the responses.
      chat=False,
      messages_field="messages",
      prompt_field="prompt",
      response_field="response",
      eval_sources=(),  # Held-out files, read in order; empty: the synthetic held-out set.
      eval_text_fields=(),  # One per eval source; empty: text_field for each.
      eval_batches=4,  # Eval batches read from eval_sources.
      # An ensemble or sweep whose members each read their own data (many tenants): one
      # tuple of sources per member, in member order, and optionally one of held-out
      # sources per member (trainer/data/members.py); empty: every member reads `sources`.
      member_sources=(),
      member_eval_sources=(),
  ))


def get_config(layout: str = "data_parallel") -> ml_collections.ConfigDict:
  if layout not in LAYOUTS:
    raise ValueError(f"configs/lm.py:{layout}: the layout must be one of {tuple(LAYOUTS)}.")
  config = base.get_config()
  config.trainer = "trainer.language_model:LanguageModelTrainer"
  # `family` picks the module (trainer.language_model.language_model): `transformer`
  # (models.TransformerLM), `gpt2` or `llama` (the Hugging Face families' modules), so every
  # layout runs every family by flag: --config.model.family=gpt2.
  config.model = ml_collections.ConfigDict(dict(
      family="transformer", vocab_size=64, num_layers=2, embed_dim=64, num_heads=8,
      head_dim=8, mlp_dim=256, max_len=64, **family_fields(), **moe_fields()))
  config.seq_len = 32
  config.batch_size = 32
  config.eval_batch_size = 32
  config.num_train_steps = 300
  config.log_every_steps = 50
  config.optimizer = "adam"
  config.learning_rate = 3e-3
  config.data = corpus_fields()

  mesh_shape, mesh_axes, rules = LAYOUTS[layout]
  config.strategy.name = "sharded_data_parallel"
  config.strategy.mesh_shape = mesh_shape
  config.strategy.mesh_axes = mesh_axes
  config.strategy.logical_axis_rules = rules
  if layout in PIPELINES:
    fields = dict(PIPELINES[layout])
    config.model.num_layers = fields.pop("num_layers")
    config.strategy.pipeline.update(fields)
  config.strategy.context.update(CONTEXTS.get(layout, {}))
  if layout in EXPERT_LAYOUTS:
    config.model.num_experts = 8
  return config
