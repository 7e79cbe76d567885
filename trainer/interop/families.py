"""The model families whose Hugging Face checkpoints this project reads and writes.

A `Family` ties an HF `model_type` to the module in `models/` that computes the
same function, and holds the mapping between the two parameter trees: a list of
`Rule`s, each an HF tensor name (`{i}` for the layer index of a stacked layer, `{e}`
for the expert's of a mixture of experts)
and this model's parameter path, with the layout change between them: each HF
axis split into the widths `split` gives it (each letter a width of the model:
`E` embed, `H` heads, `K` key/value heads, `D` head width, `F` MLP width), then
the axes reordered by `perm`. A stacked rule's layers become the leading `layer` axis
(then its experts the `expert` axis).
The same rules, inverted, write an export.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class Rule:
  """One HF tensor (per layer where `hf` holds `{i}`) <-> one parameter of ours.

  Attributes:
    hf: the HF name; `{i}` stands for the layer index, `{e}` for the expert's.
    ours: our parameter path (`/`-joined, as `config.init_from` and `config.freeze` name it).
    split: how each HF axis splits, one entry per HF axis: a width, or a tuple of widths
      it is the row-major product of (letters are model widths); () keeps the shape.
    perm: our axes as axes of the split tensor; () keeps their order.
    vocab: our axis that holds the vocabulary (None: none): the model may pad it to the
      mesh (`models.vocab`); an import pads it with zero rows, an export drops them.
  """

  hf: str
  ours: str
  split: tuple[str | int | tuple[str | int, ...], ...] = ()
  perm: tuple[int, ...] = ()
  vocab: int | None = None

  @property
  def stacked(self) -> bool:
    return "{i}" in self.hf

  @property
  def per_expert(self) -> bool:
    """One HF tensor per expert (`{e}`): ours stacks them on an `expert` axis after `layer`."""
    return "{e}" in self.hf


@dataclasses.dataclass(frozen=True)
class Family:
  """An HF model type and this project's module for it.

  Attributes:
    model_type: HF's `config.json` `model_type`.
    architecture: the HF class `transformers` loads an export as.
    prefix: a prefix HF's own saves put before every name (`transformer.`) that a
      checkpoint may also lack; exports write it.
    fields: `HF config dict -> our model's fields` (refuses what the module cannot compute).
    hf_config: `our fields -> HF config dict` (for an export).
    dims: `our fields -> {letter: width}` for `Rule.split`.
    rules: `our fields -> the rules` (which depend on e.g. tied embeddings).
    ignored: HF names (`{i}`: any layer) that hold no parameter (buffers, a tied head).
    build: `our fields -> the module` (Linen) or its factory (NNX), what `build_model`
      returns.
    module: `() -> the module's class` (imported when asked).
  """

  model_type: str
  architecture: str
  prefix: str
  fields: Callable[[Mapping[str, Any]], dict[str, Any]]
  hf_config: Callable[[Mapping[str, Any]], dict[str, Any]]
  dims: Callable[[Mapping[str, Any]], dict[str, int]]
  rules: Callable[[Mapping[str, Any]], list[Rule]]
  ignored: tuple[str, ...]
  build: Callable[[Mapping[str, Any]], Any]
  module: Callable[[], type]


class UnsupportedModelError(ValueError):
  """An HF config this project's module cannot compute (another activation, rope scaling)."""


def _refuse_unless(hf_config: Mapping[str, Any], field: str, accepted: tuple,
                   default: Any) -> None:
  value = hf_config.get(field, default)
  if value not in accepted:
    raise UnsupportedModelError(
        f"the Hugging Face config has {field}={value!r}; this project's "
        f"{hf_config.get('model_type')} computes only {field} in {accepted}.")


# -- GPT-2 -----------------------------------------------------------------------------

def _gpt2_fields(hf: Mapping[str, Any]) -> dict[str, Any]:
  _refuse_unless(hf, "activation_function", ("gelu_new", "gelu_pytorch_tanh"), "gelu_new")
  _refuse_unless(hf, "scale_attn_weights", (True,), True)
  _refuse_unless(hf, "tie_word_embeddings", (True,), True)
  _refuse_unless(hf, "add_cross_attention", (False,), False)
  embed = int(hf["n_embd"])
  return dict(family="gpt2", vocab_size=int(hf["vocab_size"]), num_layers=int(hf["n_layer"]),
              embed_dim=embed, num_heads=int(hf["n_head"]),
              mlp_dim=int(hf.get("n_inner") or 4 * embed), max_len=int(hf["n_positions"]),
              layer_norm_epsilon=float(hf.get("layer_norm_epsilon", 1e-5)),
              dropout_rate=float(hf.get("resid_pdrop", 0.1)))


def _gpt2_hf_config(f: Mapping[str, Any]) -> dict[str, Any]:
  rate = f["dropout_rate"]
  return dict(architectures=["GPT2LMHeadModel"], model_type="gpt2",
              vocab_size=f["vocab_size"], n_positions=f["max_len"], n_embd=f["embed_dim"],
              n_layer=f["num_layers"], n_head=f["num_heads"], n_inner=f["mlp_dim"],
              activation_function="gelu_new", layer_norm_epsilon=f["layer_norm_epsilon"],
              resid_pdrop=rate, embd_pdrop=rate, attn_pdrop=rate, tie_word_embeddings=True,
              dtype="float32")


def _gpt2_dims(f: Mapping[str, Any]) -> dict[str, int]:
  return dict(E=f["embed_dim"], H=f["num_heads"], D=f["embed_dim"] // f["num_heads"],
              F=f["mlp_dim"])


def _gpt2_rules(f: Mapping[str, Any]) -> list[Rule]:
  del f
  rules = [Rule("wte.weight", "token_embedding/embedding", vocab=0),
           Rule("wpe.weight", "position_embedding"),
           Rule("ln_f.weight", "ln_f/scale"), Rule("ln_f.bias", "ln_f/bias"),
           Rule("h.{i}.attn.c_attn.weight", "blocks/attn/c_attn/kernel", ("E", (3, "H", "D"))),
           Rule("h.{i}.attn.c_attn.bias", "blocks/attn/c_attn/bias", ((3, "H", "D"),)),
           Rule("h.{i}.attn.c_proj.weight", "blocks/attn/c_proj/kernel", (("H", "D"), "E")),
           Rule("h.{i}.attn.c_proj.bias", "blocks/attn/c_proj/bias")]
  for name in ("ln_1", "ln_2"):
    rules += [Rule(f"h.{{i}}.{name}.weight", f"blocks/{name}/scale"),
              Rule(f"h.{{i}}.{name}.bias", f"blocks/{name}/bias")]
  for name in ("c_fc", "c_proj"):  # HF's Conv1D keeps [in, out], as Flax does.
    rules += [Rule(f"h.{{i}}.mlp.{name}.weight", f"blocks/mlp/{name}/kernel"),
              Rule(f"h.{{i}}.mlp.{name}.bias", f"blocks/mlp/{name}/bias")]
  return rules


def _gpt2_module() -> type:
  from models.gpt2 import GPT2LM
  return GPT2LM


def _gpt2_build(f: Mapping[str, Any]) -> Any:
  return _gpt2_module()(**{k: v for k, v in f.items() if k != "family"})


GPT2 = Family("gpt2", "GPT2LMHeadModel", "transformer.", _gpt2_fields, _gpt2_hf_config,
              _gpt2_dims, _gpt2_rules,
              ignored=("h.{i}.attn.bias", "h.{i}.attn.masked_bias", "lm_head.weight"),
              build=_gpt2_build, module=_gpt2_module)


# -- Llama and the families on its module (Mistral, Qwen2, Qwen3) -----------------------

#: The rope kinds `models.llama.inverse_frequencies` computes.
ROPE_TYPES = ("default", "llama3")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
                "original_max_position_embeddings")


def _rope(hf: Mapping[str, Any]) -> dict[str, Any]:
  """`rope_theta` (and `rope_scaling`, Llama 3.1's kind) from either config form
  (transformers 5's `rope_parameters`, or the older `rope_theta` + `rope_scaling`)."""
  params = dict(hf.get("rope_parameters") or {})
  scaling = dict(hf.get("rope_scaling") or {})
  merged = {**scaling, **params}
  kind = merged.get("rope_type", merged.get("type", "default"))
  if kind not in ROPE_TYPES:
    raise UnsupportedModelError(
        f"the Hugging Face config has rope_type={kind!r}; this project's "
        f"{hf.get('model_type')} computes only rope_type in {ROPE_TYPES}.")
  _refuse_unless(merged, "partial_rotary_factor", (1.0, 1), 1.0)
  out = dict(rope_theta=float(merged.get("rope_theta", hf.get("rope_theta", 10000.0))))
  if kind == "llama3":
    missing = [k for k in _LLAMA3_KEYS if k not in merged]
    if missing:
      raise UnsupportedModelError(f"the Hugging Face config's llama3 rope lacks {missing}.")
    out["rope_scaling"] = {k: float(merged[k]) for k in _LLAMA3_KEYS}
  return out


def _no_sliding_window(hf: Mapping[str, Any]) -> None:
  """Qwen2/Qwen3: sliding-window layers (`use_sliding_window`, `layer_types`) are not
  computed."""
  _refuse_unless(hf, "use_sliding_window", (False, None), False)
  sliding = [t for t in hf.get("layer_types") or () if t != "full_attention"]
  if sliding:
    raise UnsupportedModelError(
        f"the Hugging Face config has layer_types with {sliding[0]!r} layers; this project's "
        f"{hf.get('model_type')} computes only 'full_attention' layers.")


def _llama_fields(hf: Mapping[str, Any]) -> dict[str, Any]:
  kind = hf.get("model_type")
  _refuse_unless(hf, "hidden_act", ("silu",), "silu")
  _refuse_unless(hf, "attention_bias", (False, None), False)
  _refuse_unless(hf, "mlp_bias", (False, None), False)
  if kind in ("qwen2", "qwen3"):
    _no_sliding_window(hf)
  heads = int(hf["num_attention_heads"])
  fields = dict(family=kind, vocab_size=int(hf["vocab_size"]),
                num_layers=int(hf["num_hidden_layers"]), embed_dim=int(hf["hidden_size"]),
                num_heads=heads, num_kv_heads=int(hf.get("num_key_value_heads") or heads),
                head_dim=int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
                mlp_dim=int(hf["intermediate_size"]),
                max_len=int(hf.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)), **_rope(hf))
  if kind == "mistral" and hf.get("sliding_window") is not None:
    fields["sliding_window"] = int(hf["sliding_window"])
  return fields


#: What each family on the Llama module always computes (not a field of its config).
_VARIANTS = {"llama": {}, "mistral": {}, "qwen2": dict(qkv_bias=True),
             "qwen3": dict(qk_norm=True)}
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                  "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def _llama_hf_config(f: Mapping[str, Any]) -> dict[str, Any]:
  kind = f.get("family", "llama")
  rope = dict(rope_type="default", rope_theta=f["rope_theta"])
  if f.get("rope_scaling"):
    rope.update(rope_type="llama3", **dict(f["rope_scaling"]))
  out = dict(architectures=[_ARCHITECTURES[kind]], model_type=kind,
             vocab_size=f["vocab_size"], hidden_size=f["embed_dim"],
             intermediate_size=f["mlp_dim"], num_hidden_layers=f["num_layers"],
             num_attention_heads=f["num_heads"], num_key_value_heads=f["num_kv_heads"],
             head_dim=_head_dim(f), max_position_embeddings=f["max_len"],
             rms_norm_eps=f["rms_norm_eps"], rope_theta=f["rope_theta"], rope_parameters=rope,
             tie_word_embeddings=f["tie_word_embeddings"], hidden_act="silu", dtype="float32")
  if kind in ("llama", "qwen3"):
    out.update(attention_bias=False)
  if kind == "llama":
    out.update(mlp_bias=False)
  if kind == "mistral":
    out.update(sliding_window=f.get("sliding_window"))
  if kind in ("qwen2", "qwen3"):
    out.update(use_sliding_window=False,
               layer_types=["full_attention"] * int(f["num_layers"]))
  return out


def _llama_dims(f: Mapping[str, Any]) -> dict[str, int]:
  return dict(E=f["embed_dim"], H=f["num_heads"], K=f["num_kv_heads"], D=_head_dim(f),
              F=f["mlp_dim"])


def _head_dim(f: Mapping[str, Any]) -> int:
  """The model's head width (None in `config.model`: `embed_dim // num_heads`, as the
  module and HF take it)."""
  return int(f.get("head_dim") or f["embed_dim"] // f["num_heads"])


def _llama_rules(f: Mapping[str, Any]) -> list[Rule]:
  layer, ours = "model.layers.{i}", "blocks/layers"
  rules = [Rule("model.embed_tokens.weight", "embed_tokens/embedding", vocab=0),
           Rule("model.norm.weight", "norm/scale"),
           Rule(f"{layer}.input_layernorm.weight", f"{ours}/input_layernorm/scale"),
           Rule(f"{layer}.post_attention_layernorm.weight",
                f"{ours}/post_attention_layernorm/scale"),
           # torch's Linear keeps [out, in]: ours are [in, out...].
           Rule(f"{layer}.self_attn.q_proj.weight", f"{ours}/self_attn/q_proj/kernel",
                (("H", "D"), "E"), (2, 0, 1)),
           Rule(f"{layer}.self_attn.k_proj.weight", f"{ours}/self_attn/k_proj/kernel",
                (("K", "D"), "E"), (2, 0, 1)),
           Rule(f"{layer}.self_attn.v_proj.weight", f"{ours}/self_attn/v_proj/kernel",
                (("K", "D"), "E"), (2, 0, 1)),
           Rule(f"{layer}.self_attn.o_proj.weight", f"{ours}/self_attn/o_proj/kernel",
                ("E", ("H", "D")), (1, 2, 0))]
  rules += [Rule(f"{layer}.mlp.{name}.weight", f"{ours}/mlp/{name}/kernel", (), (1, 0))
            for name in ("gate_proj", "up_proj", "down_proj")]
  variant = _VARIANTS[f.get("family", "llama")]
  if variant.get("qkv_bias"):  # Qwen2: [heads * head_dim] -> ours [heads, head_dim].
    rules += [Rule(f"{layer}.self_attn.{p}_proj.bias", f"{ours}/self_attn/{p}_proj/bias",
                   ((h, "D"),)) for p, h in (("q", "H"), ("k", "K"), ("v", "K"))]
  if variant.get("qk_norm"):  # Qwen3: one RMSNorm of head_dim for queries, one for keys.
    rules += [Rule(f"{layer}.self_attn.{p}_norm.weight", f"{ours}/self_attn/{p}_norm/scale")
              for p in ("q", "k")]
  if not f["tie_word_embeddings"]:
    rules.append(Rule("lm_head.weight", "lm_head/kernel", (), (1, 0), vocab=1))
  return rules


def _llama_module() -> type:
  from models.llama import LlamaLM
  return LlamaLM


def _llama_build(f: Mapping[str, Any]) -> Any:
  fields = {k: v for k, v in f.items() if k != "family"}
  return functools.partial(_llama_module(), **{**fields, **_VARIANTS[f.get("family", "llama")]})


def _llama_like(model_type: str) -> Family:
  return Family(model_type, _ARCHITECTURES[model_type], "", _llama_fields, _llama_hf_config,
                _llama_dims, _llama_rules,
                ignored=("model.layers.{i}.self_attn.rotary_emb.inv_freq", "lm_head.weight"),
                build=_llama_build, module=_llama_module)


LLAMA, MISTRAL, QWEN2, QWEN3 = map(_llama_like, ("llama", "mistral", "qwen2", "qwen3"))


# -- Mixtral and Qwen3-MoE: the Llama module with a mixture of experts (models/moe.py) ----

#: HF config fields of routings `models.moe` does not compute, and what each asks for.
_OTHER_ROUTING = {
    "scoring_func": ("softmax", "another scoring function than a softmax over the experts"),
    "n_shared_experts": (0, "shared experts every token passes through"),
    "shared_expert_intermediate_size": (0, "a shared expert every token passes through"),
    "n_group": (1, "grouped routing (top-k within the best expert groups)"),
    "topk_group": (1, "grouped routing (top-k within the best expert groups)"),
    "topk_method": ("greedy", "another top-k method than greedy"),
}
_MOE_FIELDS = {"mixtral": ("num_local_experts", "intermediate_size", "block_sparse_moe"),
               "qwen3_moe": ("num_experts", "moe_intermediate_size", "mlp")}
#: The per-expert weights' HF names under the block's MoE module (gate, up, down).
_EXPERT_NAMES = {"mixtral": ("w1", "w3", "w2"),
                 "qwen3_moe": ("gate_proj", "up_proj", "down_proj")}


def _check_routing(hf: Mapping[str, Any]) -> None:
  """Refuses an MoE config whose routing the module does not compute, naming the field."""
  for field, (plain, what) in _OTHER_ROUTING.items():
    value = hf.get(field)
    if value not in (None, plain, False) and not (plain == 1 and value == 0):
      raise UnsupportedModelError(
          f"the Hugging Face config has {field}={value!r}: {what}; this project's "
          f"{hf.get('model_type')} routes each token to its top-k experts by a softmax "
          f"over all experts (models/moe.py) and computes no other routing.")


def _moe_fields(hf: Mapping[str, Any]) -> dict[str, Any]:
  kind = hf.get("model_type")
  _check_routing(hf)
  _refuse_unless(hf, "router_jitter_noise", (0, 0.0, None), 0.0)
  experts_field, width_field, _ = _MOE_FIELDS[kind]
  if kind == "qwen3_moe":
    _refuse_unless(hf, "decoder_sparse_step", (1,), 1)
    if hf.get("mlp_only_layers"):
      raise UnsupportedModelError(
          f"the Hugging Face config has mlp_only_layers={hf['mlp_only_layers']!r}: dense "
          f"layers between the mixture-of-experts ones; this project's qwen3_moe has experts "
          f"in every layer.")
  fields = _llama_fields({**hf, "model_type": "qwen3" if kind == "qwen3_moe" else "mistral"})
  # transformers 5 saves Qwen3-MoE's `num_experts` as `num_local_experts`; either is read.
  experts = hf.get(experts_field) or hf.get("num_local_experts") or hf.get("num_experts")
  fields.update(family=kind, num_experts=int(experts),
                num_experts_per_tok=int(hf["num_experts_per_tok"]),
                moe_mlp_dim=int(hf[width_field]),
                norm_topk_prob=bool(hf.get("norm_topk_prob", kind == "mixtral")))
  return fields


def _moe_hf_config(f: Mapping[str, Any]) -> dict[str, Any]:
  kind = f["family"]
  experts_field, width_field, _ = _MOE_FIELDS[kind]
  base = {**f, "family": "qwen3" if kind == "qwen3_moe" else "mistral"}
  out = _llama_hf_config(base)
  out.update(architectures=[_ARCHITECTURES[kind]], model_type=kind,
             num_experts_per_tok=f["num_experts_per_tok"], router_aux_loss_coef=0.001,
             output_router_logits=False, **{experts_field: f["num_experts"]})
  width = f.get("moe_mlp_dim") or f["mlp_dim"]
  if kind == "mixtral":
    out.update(intermediate_size=width, router_jitter_noise=0.0)
  else:
    out.update(moe_intermediate_size=width, norm_topk_prob=f["norm_topk_prob"],
               decoder_sparse_step=1, mlp_only_layers=[])
  return out


def _moe_dims(f: Mapping[str, Any]) -> dict[str, int]:
  return {**_llama_dims(f), "F": int(f.get("moe_mlp_dim") or f["mlp_dim"])}


def _moe_rules(f: Mapping[str, Any]) -> list[Rule]:
  kind = f["family"]
  base = {**f, "family": "qwen3" if kind == "qwen3_moe" else "mistral"}
  rules = [r for r in _llama_rules(base) if "/mlp/" not in r.ours]
  module = f"model.layers.{{i}}.{_MOE_FIELDS[kind][2]}"
  ours = "blocks/layers/mlp"
  gate, up, down = _EXPERT_NAMES[kind]
  rules += [Rule(f"{module}.gate.weight", f"{ours}/gate/kernel", (), (1, 0)),
            Rule(f"{module}.experts.{{e}}.{gate}.weight", f"{ours}/gate_proj", (), (1, 0)),
            Rule(f"{module}.experts.{{e}}.{up}.weight", f"{ours}/up_proj", (), (1, 0)),
            Rule(f"{module}.experts.{{e}}.{down}.weight", f"{ours}/down_proj", (), (1, 0))]
  return rules


def _moe_build(f: Mapping[str, Any]) -> Any:
  if not f.get("num_experts"):  # A dense model would train, and no export could write it.
    raise ValueError(f"config.model.family={f['family']!r} is a mixture of experts, but "
                     f"config.model.num_experts={f.get('num_experts')!r}; set it (e.g. "
                     f"--config.model.num_experts=8), or pick a dense family "
                     f"('llama', 'mistral', 'qwen2', 'qwen3').")
  fields = {k: v for k, v in f.items() if k != "family"}
  variant = _VARIANTS["qwen3" if f["family"] == "qwen3_moe" else "mistral"]
  return functools.partial(_llama_module(), **{**fields, **variant})


def _moe_family(model_type: str) -> Family:
  return Family(model_type, _ARCHITECTURES[model_type], "", _moe_fields, _moe_hf_config,
                _moe_dims, _moe_rules,
                ignored=("model.layers.{i}.self_attn.rotary_emb.inv_freq", "lm_head.weight"),
                build=_moe_build, module=_llama_module)


_ARCHITECTURES.update(mixtral="MixtralForCausalLM", qwen3_moe="Qwen3MoeForCausalLM")
MIXTRAL, QWEN3_MOE = map(_moe_family, ("mixtral", "qwen3_moe"))

FAMILIES = {family.model_type: family
            for family in (GPT2, LLAMA, MISTRAL, QWEN2, QWEN3, MIXTRAL, QWEN3_MOE)}


def module_fields(family: str = "transformer", **fields) -> dict[str, Any]:
  """`config.model`'s fields for `family`'s module, `family` included: the ones set (not
  None), each other field of the module at its default (`trainer.language_model.model_fields`
  is this).

  Raises:
    ValueError: a field set (not None) that the family's module does not have.
  """
  import dataclasses
  import inspect

  if family == "transformer":
    import models
    module = models.TransformerLM
  else:
    module = get(family, field="config.model.family").module()
  if dataclasses.is_dataclass(module):  # Linen: its dataclass fields.
    defaults = {f.name: f.default for f in dataclasses.fields(module)
                if f.name not in ("parent", "name")}
  else:  # NNX: its constructor's keyword arguments.
    defaults = {name: p.default for name, p in inspect.signature(module.__init__).parameters
                .items() if name not in ("self", "rngs")}
  fields = {name: value for name, value in fields.items() if value is not None}
  unknown = sorted(set(fields) - set(defaults))
  if unknown:
    raise ValueError(f"config.model.{unknown[0]}={fields[unknown[0]]!r}: the {family!r} "
                     f"family's model has no such field (it takes {sorted(defaults)}); leave "
                     f"it None, or pick the family that has it (config.model.family).")
  kept = {name: value for name, value in defaults.items()
          if value is not dataclasses.MISSING and value is not inspect.Parameter.empty}
  return {**kept, **fields, "family": family}


def get(model_type: str, *, field: str = "model_type") -> Family:
  """The family of an HF `model_type` (or of `config.model.family`)."""
  if model_type not in FAMILIES:
    raise UnsupportedModelError(f"{field}={model_type!r} has no mapping here; the families "
                                f"with one are {sorted(FAMILIES)}.")
  return FAMILIES[model_type]
