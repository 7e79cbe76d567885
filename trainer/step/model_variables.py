"""The one place that knows Linen from NNX: init, apply, train/eval mode and variables.

A `Trainer` keeps a model's variables in its `TrainState` as two pytrees:
`params` (what the optimizer updates, with Flax logical-axis boxes where the
module annotates them, which is what the sharded strategies read) and
`model_state` (every other collection, e.g. BatchNorm's `batch_stats`, updated
by the train step and read in eval). `ModelVariables` turns a user's module
into pure functions over those two trees:

- `LinenVariables` wraps an `nn.Module`;
- `NnxVariables` wraps a factory `rngs -> nnx.Module` (the module's class, or a
  `functools.partial` of it), built inside the traced init so that ensemble
  members and seeds each get their own parameters and nothing is materialised
  on one device first. In a step the module is rebuilt from the step's RNG
  streams, then its parameters and state are replaced (`nnx.update`): the
  discarded initialisers are dead code the compiler drops (no NNX transform is used).

RNG streams: the step's keys come as a `trainer.step.rng_streams.RngStreams` mapping;
an NNX module whose `__call__` takes `rngs` (Flax's own NNX examples do) gets the
step's `nnx.Rngs` there.

BatchNorm without `axis_name`: with `sync_batchnorm` such a layer is bound to
the step's data axis (`strategies.BATCH_AXIS`), which is what Lightning's
`sync_batchnorm` does for PyTorch; without it, a strategy whose step sees a
shard of the batch refuses it (its statistics would silently be per replica).

Train/eval mode: a Linen module gets `train=` (or `training=`/`is_training=`)
and `deterministic=` call arguments its `__call__` declares, and a top-level
`deterministic`/`train` field (or one on a dataclass field such as the Flax
lm1b/wmt examples' `config`) is set by `clone`; an NNX module is viewed with
`deterministic` and `use_running_average` set, as `nnx.Module.eval()` does.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
from flax import nnx
from jax.sharding import PartitionSpec

from strategies.mesh import BATCH_AXIS
from trainer.step.lora import Lora
from trainer.step.precision import embeddings_follow_their_tables
from trainer.step.remat import Remat, class_names
from trainer.step.rng_streams import MissingRngStreamError, RngStreams  # noqa: F401 (moved)

PyTree = Any
Rngs = Mapping[str, jax.Array]
Inputs = tuple[tuple, dict]  # Positional and keyword arguments of the model call.

#: Call arguments and module fields that carry the train/eval mode, and their value in training.
_MODE_ARGUMENTS = {"train": True, "training": True, "is_training": True, "deterministic": False}
#: Collections a Linen init may return that are not state to carry between steps.
_NOT_STATE = ("params", "intermediates")
#: The NNX variables that make up `model_state`: everything but parameters and RNG state.
_NNX_MODEL_STATE = nnx.Not(nnx.Any(nnx.Param, nnx.RngState))


def _mode_value(name: str, train: bool) -> bool:
  """The value of mode argument or field `name` in training (`train`) or eval."""
  return train if _MODE_ARGUMENTS[name] else not train


def _under_attention(method, *, init: bool = False):
  """`method` run with the shared attention's method set (`models.attention.using`)."""

  @functools.wraps(method)
  def traced(self, *args, **kwargs):
    from models import attention
    with attention.using(attention.at_init(self.attention) if init else self.attention):
      return method(self, *args, **kwargs)

  return traced


class ModelVariables(abc.ABC):
  """Init and apply of one module as pure functions of `(params, model_state)`."""

  #: Whether the module is a Linen one (else NNX): how variable paths are named.
  linen: bool = True
  #: The shared attention's method while the model is traced (`models.attention.Method`).
  attention: Any = None

  @abc.abstractmethod
  def init(self, rngs: Rngs, inputs: Inputs) -> tuple[PyTree, PyTree]:
    """`(params, model_state)` of a new model, from `rngs` (with a `params` stream)."""

  @abc.abstractmethod
  def apply(self, params: PyTree, model_state: PyTree, inputs: Inputs, *, rngs: Rngs,
            train: bool, require_batch_axis: bool = False) -> tuple[Any, PyTree]:
    """`(outputs, new model_state)`; in eval mode the state comes back unchanged.

    Args:
      require_batch_axis: raise if a BatchNorm in training would normalise over
        its local batch only (no `axis_name`): strategies whose step sees a
        shard of the batch set it, so statistics are never silently per replica.
    """

  @abc.abstractmethod
  def decode(self, params: PyTree, model_state: PyTree, cache: PyTree | None, inputs: Inputs,
             *, rngs: Rngs, length: int) -> tuple[Any, PyTree]:
    """`(outputs, cache)` of an eval-mode call that decodes with a key/value cache of
    `length` slots (`models.kv_cache`): `cache` None makes a new one (every row's index 0).
    The cache is nested dicts whose leaves are boxed with their logical names (Linen's
    `LogicallyPartitioned`), Linen and NNX alike.

    Raises:
      TypeError: a model whose attention keeps no cache.
    """

  @property
  @abc.abstractmethod
  def module(self) -> Any:
    """The user's module (Linen) or factory (NNX)."""


def create(model: Any, *, sync_batchnorm: bool = False,
           remat: Remat | None = None, lora: Lora | None = None,
           attention: Any = None) -> ModelVariables:
  """The `ModelVariables` for what `Trainer.build_model` returned.

  Args:
    sync_batchnorm: bind every BatchNorm that has no `axis_name` to the step's
      data axis, so its statistics are over the global batch (per member).
    remat: checkpoint the training forward pass, or the named modules' calls
      (`trainer.step.remat`); None: keep every activation.
    lora: add low-rank adapters to the weights it targets (`trainer.step.lora`: Qwix's
      for a Linen module, folded into the weights for an NNX one or under a pipeline);
      None: the model as it is.
    attention: the `models.attention.Method` the shared attention runs by while the
      model is traced (`config.attention`); None: plain.

  Raises:
    TypeError: an NNX module instance (its parameters exist already, so every
      ensemble member would share them) or something that is not a model.
  """
  if isinstance(model, nn.Module):
    return LinenVariables(model, sync_batchnorm=sync_batchnorm, remat=remat, lora=lora,
                          attention=attention)
  if isinstance(model, nnx.Module):
    raise TypeError(
        f"build_model returned an nnx.Module instance ({type(model).__name__}); return its "
        f"factory instead, e.g. `functools.partial({type(model).__name__}, ...)` without "
        f"`rngs`: the Trainer builds it with `rngs=nnx.Rngs(...)` inside the traced init, so "
        f"every seed and ensemble member gets its own parameters, created where the "
        f"strategy places them.")
  if callable(model):
    return NnxVariables(model, sync_batchnorm=sync_batchnorm, remat=remat, lora=lora,
                        attention=attention)
  raise TypeError(f"build_model returned {model!r}; expected a flax.linen Module or a "
                  f"factory `rngs -> nnx.Module`.")


def _batch_norm_error(path: str) -> ValueError:
  return ValueError(
      f"BatchNorm {path!r} normalises over its local batch (axis_name=None) in training, but "
      f"this strategy's step sees a shard of the batch: its statistics would be per replica "
      f"and differ from a single device. Set axis_name=strategies.BATCH_AXIS ('batch'): every "
      f"strategy binds that axis, and its statistics are then over the global batch (per "
      f"member in ensembles). For a model you do not want to edit, set "
      f"config.sync_batchnorm=True: the trainer binds that axis for every BatchNorm without "
      f"one.")


class LinenVariables(ModelVariables):
  """A `flax.linen.Module`: `params` plus its other collections as `model_state`."""

  def __init__(self, module: nn.Module, *, sync_batchnorm: bool = False,
               remat: Remat | None = None, lora: Lora | None = None, attention: Any = None):
    self._module = module
    self.attention = attention
    self._sync_batchnorm = sync_batchnorm
    self._remat = remat
    self._lora = lora
    self._adapted: nn.Module | None = None  # The module with LoRA adapters, once made.
    call = inspect.signature(type(module).__call__).parameters
    self._mode_args = [name for name in _MODE_ARGUMENTS if name in call]

  @property
  def module(self) -> nn.Module:
    return self._module

  def _with_lora(self, args: tuple, kwargs: dict) -> nn.Module:
    """The module, with Qwix's adapters on the weights `config.lora.targets` match (found
    from the parameter paths of an abstract init in eval mode, once)."""
    if self._lora is None:
      return self._module
    if self._adapted is None:
      kwargs = {**kwargs, **{name: _mode_value(name, False) for name in self._mode_args}}
      import qwix

      from strategies.tree import keypath_str

      def shapes(module):
        with nn.logical_axis_rules(()):  # See `init`: Qwix's adapters without rules.
          variables = jax.eval_shape(lambda: module.init(
              {"params": jax.random.PRNGKey(0)}, *args, **kwargs))
        return {keypath_str(p, drop_box=True): tuple(x.shape) for p, x in
                jax.tree_util.tree_leaves_with_path(variables.get("params", {}))}

      base = _with_mode_fields(self._module, False)
      base_shapes = shapes(base)
      base_paths = list(base_shapes)
      adapters_only = dataclasses.replace(self._lora, base=None)
      adapted = qwix.apply_lora_to_model(self._module, adapters_only.provider(base_paths))
      adapted_paths = list(shapes(_with_mode_fields(adapted, False)))
      self._lora.check_adapted(base_paths, adapted_paths)
      if self._lora.base is not None:
        self._lora.base.refuse_training(adapted_paths)
      if self._lora.base is not None and self._lora.base.quantized:  # The base quantized.
        from trainer.step import quantized_base
        probe = qwix.apply_lora_to_model(  # Which axes each quantized weight's products take.
            self._module, quantized_base.probe_provider(self._lora.base, base_paths))
        quantized_base.linen_weights(self._lora.base, base_shapes,
                                     shapes(_with_mode_fields(probe, False)))
        adapted = qwix.apply_lora_to_model(self._module, self._lora.provider(base_paths))
      self._adapted = adapted
    return self._adapted

  def _in_mode(self, inputs: Inputs, train: bool) -> tuple[nn.Module, tuple, dict]:
    """The module with its mode fields set, and the call's arguments with its mode arguments."""
    args, kwargs = inputs
    kwargs = dict(kwargs)
    for name in self._mode_args:
      kwargs.setdefault(name, _mode_value(name, train))
    return _with_mode_fields(self._with_lora(args, kwargs), train), args, kwargs

  @functools.partial(_under_attention, init=True)
  def init(self, rngs: Rngs, inputs: Inputs) -> tuple[PyTree, PyTree]:
    module, args, kwargs = self._in_mode(inputs, train=False)
    seen: set[str] = set()

    def record(next_fun, args, kwargs, context):
      seen.update(class_names(context.module))
      return next_fun(*args, **kwargs)

    named = self._remat is not None and bool(self._remat.modules)
    with contextlib.ExitStack() as stack:
      if named:
        stack.enter_context(nn.intercept_methods(record))
      if self._lora is not None:
        # Qwix boxes a new adapter in its weight's metadata and unboxes it, which under
        # logical rules constrains it by the weight's rank; creating them without rules
        # keeps the names (the strategy lays the state out from them afterwards).
        stack.enter_context(nn.logical_axis_rules(()))
      variables = dict(module.init(dict(rngs), *args, **kwargs))
    if named:
      self._remat.check_found(seen)
    params = variables.pop("params", {})
    if self._lora is not None and self._lora.base is not None and not self._lora.base.quantized:
      params = self._lora.base.cast(params)  # A base stored in another float dtype.
    return params, {k: v for k, v in variables.items() if k not in _NOT_STATE}

  def _for_call(self, params, inputs, train):
    """The module in its mode, its call's arguments and the parameters it takes."""
    module, args, kwargs = self._in_mode(inputs, train)
    if self._lora is not None and self._lora.fold:  # Qwix made them; the weights take them.
      from trainer.step.lora import merge_adapters
      from trainer.step.quantized_base import dequantized
      module = _with_mode_fields(self._module, train)
      params = merge_adapters(dequantized(nn.meta.unbox(params)), self._lora)
    return module, args, kwargs, params

  @_under_attention
  def decode(self, params, model_state, cache, inputs, *, rngs, length):
    from models import kv_cache
    module, args, kwargs, params = self._for_call(params, inputs, train=False)
    variables = {"params": params, **model_state, **({"cache": cache} if cache else {})}
    with kv_cache.decoding(length):
      outputs, updated = module.apply(variables, *args, rngs=dict(rngs), mutable=["cache"],
                                      **kwargs)
    if not updated.get("cache"):
      raise TypeError(
          f"{type(self._module).__name__} kept no key/value cache: decoding needs its "
          f"attention to call models.kv_cache.attend under kv_cache.decoding() (as "
          f"models.transformer and models.gpt2 do).")
    return outputs, updated["cache"]

  @_under_attention
  def apply(self, params, model_state, inputs, *, rngs, train, require_batch_axis=False):
    module, args, kwargs, params = self._for_call(params, inputs, train)
    variables = {"params": params, **model_state}
    mutable = list(model_state) if train and model_state else False
    with contextlib.ExitStack() as stack:
      if self._sync_batchnorm:
        stack.enter_context(nn.intercept_methods(_linen_sync_batch_norm))
      elif train and require_batch_axis:
        stack.enter_context(nn.intercept_methods(_linen_batch_norm_check))
      remat = self._remat if train else None
      if remat and remat.modules:
        stack.enter_context(nn.intercept_methods(remat.linen_interceptor()))
      if remat and not remat.modules:
        result = remat.call(module.apply, variables, *args, rngs=dict(rngs), mutable=mutable,
                            **kwargs)
      else:
        result = module.apply(variables, *args, rngs=dict(rngs), mutable=mutable, **kwargs)
    if mutable:
      outputs, updated = result
      return outputs, {**model_state, **updated}
    return result, model_state


def _linen_batch_norm_check(next_fun, args, kwargs, context):
  module = context.module
  if isinstance(module, nn.BatchNorm) and context.method_name == "__call__" and (
      module.axis_name is None):
    use_running_average = nn.merge_param(
        "use_running_average", module.use_running_average,
        kwargs.get("use_running_average", args[1] if len(args) > 1 else None))
    if not use_running_average:
      raise _batch_norm_error("/".join(module.scope.path) if module.scope else module.name)
  return next_fun(*args, **kwargs)


def _linen_sync_batch_norm(next_fun, args, kwargs, context):
  """Calls a BatchNorm that has no `axis_name` as one bound to the step's data axis."""
  module = context.module
  if (isinstance(module, nn.BatchNorm) and context.method_name == "__call__"
      and module.axis_name is None):
    # Linen modules are frozen dataclasses; this bound copy lives for one apply only.
    object.__setattr__(module, "axis_name", BATCH_AXIS)
  return next_fun(*args, **kwargs)


def _with_mode_fields(module: nn.Module, train: bool) -> nn.Module:
  """`module` with a top-level mode field, or one on a dataclass-valued field, set for `train`."""
  fields = {f.name: getattr(module, f.name) for f in dataclasses.fields(module)
            if f.name not in ("parent", "name")}
  updates = {}
  for name, value in fields.items():
    if name in _MODE_ARGUMENTS and isinstance(value, bool):
      updates[name] = _mode_value(name, train)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
      inner = {f.name: _mode_value(f.name, train)
               for f in dataclasses.fields(value)
               if f.name in _MODE_ARGUMENTS and isinstance(getattr(value, f.name), bool)}
      if inner:
        updates[name] = dataclasses.replace(value, **inner)
  return module.clone(**updates) if updates else module


def _boxed_tree(state: Mapping) -> dict:
  """An `nnx.State` as nested dicts of arrays; annotated ones boxed with their names (a
  `PartitionSpec`'s as mesh axes, `nn.Partitioned`; other names as logical ones)."""
  out = {}
  for key, value in state.items():
    if isinstance(value, nnx.Variable):
      names = value.get_metadata().get("out_sharding")
      array = value.get_value()
      # A PartitionSpec names mesh axes; a tuple of names may be logical ones.
      box = nn.Partitioned if isinstance(names, PartitionSpec) else nn.LogicallyPartitioned
      out[key] = box(array, tuple(names)) if names else array
    else:
      out[key] = _boxed_tree(value)
  return out


def _with_default(rngs: Rngs) -> dict[str, jax.Array]:
  """The streams as a plain dict with a `default` one (what `nnx.Rngs` falls back to)."""
  streams = dict(rngs)
  streams.setdefault("default", next(iter(streams.values())))
  return streams


class NnxVariables(ModelVariables):
  """An NNX module built by `factory(rngs=nnx.Rngs(...))`: `nnx.Param` variables as params, the rest
  (e.g. `BatchStat`) except RNG state as `model_state`.

  RNG streams never live in the train state: each step rebuilds the module from
  that step's keys, so its randomness is a function of `(state.rng, step)`.
  """

  linen = False

  def __init__(self, factory: Callable[..., nnx.Module], *, sync_batchnorm: bool = False,
               remat: Remat | None = None, lora: Lora | None = None, attention: Any = None):
    self._factory = factory
    self.attention = attention
    self._sync_batchnorm = sync_batchnorm
    self._remat = remat
    self._lora = lora  # Folded into the weights (`trainer.step.lora.merge_adapters`).
    self._call: inspect.Signature | None = None  # `__call__`'s, known once a module exists.

  @property
  def module(self) -> Callable[..., nnx.Module]:
    return self._factory

  def _build(self, rngs: Rngs) -> nnx.Module:
    streams = _with_default(rngs)
    # The strategy places the arrays (from the logical annotations) itself.
    with nnx.use_eager_sharding(False):
      model = self._factory(rngs=nnx.Rngs(**streams))
    if not isinstance(model, nnx.Module):
      raise TypeError(f"build_model's factory returned {type(model).__name__}, not an "
                      f"nnx.Module.")
    if self._sync_batchnorm:
      for _, module in nnx.iter_modules(model):
        if isinstance(module, nnx.BatchNorm) and module.axis_name is None:
          module.axis_name = BATCH_AXIS
    if self._call is None:
      self._call = inspect.signature(type(model).__call__)
    return model

  def _takes_rngs(self, model: nnx.Module, args: tuple, kwargs: dict) -> bool:
    """Whether `__call__` takes `rngs` and `model_inputs` left it unbound (neither passed
    it by keyword nor, positionally, filled its place)."""
    if "rngs" not in self._call.parameters or "rngs" in kwargs:
      return False
    try:
      bound = self._call.bind_partial(model, *args, **kwargs)
    except TypeError:
      return False  # Arguments `__call__` cannot take: the call itself says so.
    return "rngs" not in bound.arguments

  @staticmethod
  def _split(model: nnx.Module) -> tuple[dict, dict]:
    params = nnx.state(model, nnx.Param)
    rest = nnx.state(model, _NNX_MODEL_STATE)
    return _boxed_tree(params), nnx.to_pure_dict(rest)

  @functools.partial(_under_attention, init=True)
  def init(self, rngs: Rngs, inputs: Inputs) -> tuple[PyTree, PyTree]:
    model = self._build(rngs)
    if self._remat and self._remat.modules:
      self._remat.check_found(name for _, m in nnx.iter_modules(model) for name in class_names(m))
    params, model_state = self._split(model)
    if self._lora is not None:
      from trainer.step import lora
      weights = lora.nnx_weights(model)
      params = lora.add_adapters(params, weights, self._lora, dict(rngs)["params"])
      if self._lora.base is not None:
        from trainer.step.quantized_base import quantize
        params = quantize(params, weights, self._lora.base)
    return params, model_state

  @_under_attention
  def decode(self, params, model_state, cache, inputs, *, rngs, length):
    model = self._with_values(params, model_state, rngs, train=False)
    init_cache = getattr(model, "init_cache", None)
    if init_cache is None:
      raise TypeError(
          f"{type(model).__name__} has no init_cache(batch, length, dtype): decoding an NNX "
          f"model needs the method that gives its attention layers a key/value cache "
          f"(models.kv_cache.cache_variables; models.llama.LlamaLM.init_cache).")
    args, kwargs = inputs
    with nnx.use_eager_sharding(False):  # The program's layout comes from the annotations.
      init_cache(jax.tree.leaves(args)[0].shape[0], length)
    if cache is not None:
      made = nnx.state(model, nnx.Cache)
      nnx.replace_by_pure_dict(made, nn.meta.unbox(cache))
      nnx.update(model, made)
    outputs = model(*args, **kwargs)
    return outputs, _boxed_tree(nnx.state(model, nnx.Cache))  # As a Linen cache: named.

  def _with_values(self, params, model_state, rngs, *, train: bool) -> nnx.Module:
    """The module built from `rngs` with `params` and `model_state` in it, in its mode."""
    model = self._build(rngs)
    values = nnx.state(model, nnx.Param)
    params = nn.meta.unbox(params)
    if self._lora is not None:
      from trainer.step.lora import merge_adapters
      from trainer.step.quantized_base import dequantized
      params = merge_adapters(dequantized(params), self._lora)
    nnx.replace_by_pure_dict(values, params)
    rest = nnx.state(model, _NNX_MODEL_STATE)
    nnx.replace_by_pure_dict(rest, model_state)
    nnx.update(model, values, rest)
    embeddings_follow_their_tables(model)  # Under a bfloat16 step: computes in bfloat16.
    return nnx.view(model, deterministic=not train, use_running_average=not train,
                    raise_if_not_found=False)

  @_under_attention
  def apply(self, params, model_state, inputs, *, rngs, train, require_batch_axis=False):
    model = self._with_values(params, model_state, rngs, train=train)
    if train and require_batch_axis:
      for path, module in nnx.iter_modules(model):
        if isinstance(module, nnx.BatchNorm) and module.axis_name is None:
          raise _batch_norm_error("/".join(map(str, path)))
    args, kwargs = inputs
    if self._takes_rngs(model, args, kwargs):  # Flax's NNX examples: __call__(x, rngs).
      kwargs = {**kwargs, "rngs": nnx.Rngs(**_with_default(rngs))}
    remat = self._remat if train else None
    if remat and remat.modules:
      remat.nnx_apply(model)
    outputs = (remat.nnx_call(model, *args, **kwargs) if remat and not remat.modules
               else model(*args, **kwargs))
    if not train:
      return outputs, model_state
    return outputs, self._split(model)[1]
