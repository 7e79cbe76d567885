"""Tools and environments a rollout may call, as TRL 1.16's `GRPOTrainer` takes them.

A tool is a typed Python function with a Google-style docstring::

    def lookup(key: str) -> str:
      '''The table's entry for a key.

      Args:
        key: the row to read.
      '''

Its JSON schema (`schema_of`) is what `transformers.utils.get_json_schema` makes of it:
the name, the docstring's description, and each parameter's JSON type (`int` integer,
`float` number, `str` string, `bool` boolean, `list[...]` array, `dict[...]` object,
`Literal[...]` and `Enum` an enum, `X | None` nullable) with its description; the
parameters without a default are required. The model's chat template renders the
schemas into the prompt (`tools=`), as `apply_chat_template(..., tools=...)` does.

An environment is a class (`config.rl.environment`): one instance per rollout, built
with no arguments. Its `reset(**record)` is called with the prompt's record before the
rollout and returns None or text appended to the last user message; its other public
methods are tools; an optional `get_reward()` is one more reward (named after the class,
weight 1). `reset` may take a `seed` parameter: it then gets a seed derived from the
step and the row, so a rerun of a step calls the environment as the first run did.

A config names tools and the environment as rewards are named: `"package.module:name"`
or `"path/to/file.py:name"` (`trainer.rl.rewards`). Everything here is checked when the
trainer is built, before anything compiles.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import inspect
import json
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from trainer.rl import rewards as rewards_lib

_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean",
               type(None): "null"}
_PLAIN = {**{t: {"type": n} for t, n in _JSON_TYPES.items()}, list: {"type": "array"},
          tuple: {"type": "array"}, dict: {"type": "object"}, Any: {}}


class ToolError(ValueError):
  """A tool or an environment that cannot be offered to the model, naming it."""


def _enum(values: list, where: str) -> dict:
  bad = [v for v in values if type(v) not in _JSON_TYPES]
  if bad:
    raise ToolError(f"{where}: the enum values {bad!r} are not JSON scalars (int, float, "
                    f"str, bool or None).")
  kinds = list(dict.fromkeys(_JSON_TYPES[type(v)] for v in values))
  return {"type": kinds[0] if len(kinds) == 1 else kinds, "enum": list(values)}


def _type_schema(hint: Any, where: str) -> dict:
  """The JSON schema of one type hint (the module docstring's mapping)."""
  origin, args = typing.get_origin(hint), typing.get_args(hint)
  if origin is None:
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
      if not list(hint):
        raise ToolError(f"{where}: the Enum {hint.__name__} has no members.")
      return _enum([m.value for m in hint], where)
    if hint in _PLAIN:
      return dict(_PLAIN[hint])
    raise ToolError(f"{where}: the type {hint!r} has no JSON schema; a tool's parameters "
                    f"take int, float, str, bool, list, tuple, dict, Literal, Enum and "
                    f"unions of them.")
  if origin is typing.Union or origin is types.UnionType:
    parts = [_type_schema(a, where) for a in args if a is not type(None)]
    if len(parts) == 1:
      out = parts[0]
    elif all(set(p) == {"type"} and isinstance(p["type"], str) for p in parts):
      kinds = sorted({p["type"] for p in parts})
      out = {"type": kinds[0] if len(kinds) == 1 else kinds}
    else:
      out = {"anyOf": parts}
    if type(None) in args:
      out["nullable"] = True
    return out
  if origin is typing.Literal and args:
    return _enum(list(args), where)
  if origin is list:
    return {"type": "array", **({"items": _type_schema(args[0], where)} if args else {})}
  if origin is tuple:
    if len(args) == 1 or ... in args:
      raise ToolError(f"{where}: {hint!r}: a tuple parameter lists each element's type "
                      f"(use list[...] for any length).")
    return {"type": "array", **({"prefixItems": [_type_schema(a, where) for a in args]}
                                if args else {})}
  if origin is dict:
    return {"type": "object", **({"additionalProperties": _type_schema(args[1], where)}
                                 if len(args) == 2 else {})}
  raise ToolError(f"{where}: the type {hint!r} has no JSON schema.")


_SECTION = re.compile(r"^\s*(Args|Returns|Raises):\s*$")
_ARG = re.compile(r"^(\s*)(\w+)\s*(?:\([^()]*\))?\s*:\s*(.*)$")


def _docstring(doc: str) -> tuple[str, dict[str, str], str | None]:
  """A Google-style docstring's description, its `Args:` descriptions (each on one line)
  and its `Returns:` text."""
  lines = doc.strip().splitlines()
  sections: dict[str, list[str]] = {"": []}
  current = ""
  for line in lines:
    match = _SECTION.match(line)
    if match:
      current = match.group(1)
      sections.setdefault(current, [])
      continue
    sections[current].append(line)
  description = "\n".join(sections[""]).strip()
  args: dict[str, str] = {}
  name, indent = None, None
  for line in sections.get("Args", []):
    if not line.strip():
      continue
    match = _ARG.match(line)
    if match and (indent is None or len(match.group(1)) <= indent):
      indent, name = len(match.group(1)), match.group(2)
      args[name] = match.group(3).strip()
    elif name is not None:
      args[name] = (args[name] + " " + line.strip()).strip()
  returns = sections.get("Returns")
  return description, args, ("\n".join(returns).strip() or None
                             if returns is not None else None)


def schema_of(fn: Callable, *, where: str = "") -> dict:
  """`fn`'s tool schema, as `transformers.utils.get_json_schema` makes it.

  Raises:
    ToolError: no docstring, a parameter without a type hint or a description, or a type
      with no JSON schema, naming the function and the parameter.
  """
  name = getattr(fn, "__name__", "operation")
  where = where or f"the tool {name!r}"
  doc = inspect.getdoc(fn)
  if not doc:
    raise ToolError(f"{where} has no docstring; a tool needs one (Google style: a "
                    f"description, then 'Args:' with a line per parameter), which the "
                    f"model reads in its prompt.")
  description, described, returns = _docstring(doc)
  signature = inspect.signature(fn)
  try:
    hints = typing.get_type_hints(fn)
  except Exception as e:  # An annotation that does not resolve.
    raise ToolError(f"{where}: its type hints do not resolve ({e}).") from e
  parameters = list(signature.parameters.values())
  if parameters and parameters[0].name in ("self", "cls") and (
      parameters[0].annotation is inspect.Parameter.empty):
    parameters = parameters[1:]
  properties, required = {}, []
  for p in parameters:
    if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
      raise ToolError(f"{where}: *{p.name} has no schema; a tool names each parameter.")
    if p.annotation is inspect.Parameter.empty:
      raise ToolError(f"{where}: the parameter {p.name!r} has no type hint; every parameter "
                      f"of a tool needs one (int, float, str, bool, list[...], ...).")
    if p.name not in described:
      raise ToolError(f"{where}: the docstring's 'Args:' does not describe {p.name!r}; "
                      f"every parameter needs a line ('{p.name}: what it is').")
    schema = _type_schema(hints[p.name], f"{where}, parameter {p.name!r}")
    text = described[p.name]
    choices = re.search(r"\(choices:\s*(.*?)\)\s*$", text, flags=re.IGNORECASE)
    if choices:
      schema["enum"] = [c.strip() if isinstance(c, str) else c
                        for c in json.loads(choices.group(1))]
      text = text[:choices.start()].strip()
    schema["description"] = text
    properties[p.name] = schema
    if p.default is inspect.Parameter.empty:
      required.append(p.name)
  parameters_schema: dict[str, Any] = {"type": "object", "properties": properties}
  if required:
    parameters_schema["required"] = required
  function: dict[str, Any] = {"name": name, "description": description,
                              "parameters": parameters_schema}
  if "return" in hints:
    try:
      back = _type_schema(hints["return"], where)
    except ToolError:
      back = None
    if back is not None:
      if returns is not None:
        back["description"] = returns
      function["return"] = back
  return {"type": "function", "function": function}


@dataclasses.dataclass(frozen=True)
class Tool:
  """A function the model may call: its name, its schema, and the function."""

  name: str
  fn: Callable[..., Any]
  schema: dict


def _tool(fn: Callable, where: str) -> Tool:
  return Tool(getattr(fn, "__name__", "operation"), fn, schema_of(fn, where=where))


def environment_methods(cls: type) -> list[str]:
  """An environment class's tools: its public functions but `reset` and `get_reward`."""
  return [n for n, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
          if n not in ("reset", "get_reward") and not n.startswith("_")]


@dataclasses.dataclass(frozen=True)
class Toolbox:
  """What a rollout offers the model: standalone tools, and an environment class whose
  instances (one per rollout) add their methods."""

  tools: tuple[Tool, ...]
  environment: type | None = None

  @property
  def schemas(self) -> list[dict]:
    """Every tool's schema, in the order the prompt lists them (TRL's: the standalone
    tools, then the environment's methods by name)."""
    return [t.schema for t in self.tools] + list(self._method_schemas)

  @property
  def _method_schemas(self) -> list[dict]:
    if self.environment is None:
      return []
    return [schema_of(getattr(self.environment, n), where=f"{self.environment.__name__}.{n}")
            for n in environment_methods(self.environment)]

  @property
  def rewarded(self) -> bool:
    """Whether the environment has a `get_reward` (one more reward source)."""
    return self.environment is not None and callable(getattr(self.environment, "get_reward",
                                                             None))

  def new_environment(self):
    return None if self.environment is None else self.environment()

  def functions(self, environment=None) -> dict[str, Callable]:
    """The callables of one rollout, by name: the tools and its environment's methods."""
    out = {t.name: t.fn for t in self.tools}
    if environment is not None:
      out.update({n: getattr(environment, n) for n in environment_methods(type(environment))})
    return out

  def reset(self, environment, record: Mapping[str, Any], seed: int) -> str | None:
    """`environment.reset(**record)` (with `seed=` where it takes one): None or the text
    appended to the prompt's last user message."""
    kwargs = dict(record)
    if "seed" in inspect.signature(environment.reset).parameters:
      kwargs["seed"] = seed
    out = environment.reset(**kwargs)
    if out is not None and not isinstance(out, str):
      raise ToolError(f"{type(environment).__name__}.reset returned {type(out).__name__}; it "
                      f"returns None or text appended to the last user message.")
    return out


def load(tool_specs: Sequence[str], environment_spec: str | None = None) -> Toolbox | None:
  """The toolbox `config.rl.tools` and `config.rl.environment` name (None: neither).

  Raises:
    ToolError: naming the spec: one that cannot be imported, a tool without type hints
      or a docstring, two tools with one name, an environment that is not a class or has
      no `reset`.
  """
  tools = []
  for spec in tool_specs:
    fn = rewards_lib.named(spec, where="config.rl.tools", what="tool")
    tools.append(_tool(fn, f"config.rl.tools: {spec!r}"))
  environment = None
  if environment_spec:
    environment = rewards_lib.named(environment_spec, where="config.rl.environment",
                                    what="environment class")
    if not inspect.isclass(environment):
      raise ToolError(f"config.rl.environment={environment_spec!r} is a "
                      f"{type(environment).__name__}; it names a class, built once per "
                      f"rollout with no arguments (TRL's environment_factory).")
    if not callable(getattr(environment, "reset", None)):
      raise ToolError(f"config.rl.environment={environment_spec!r}: the class "
                      f"{environment.__name__} has no reset method; an environment defines "
                      f"reset(**record) -> None or text, and its tools as public methods.")
  if not tools and environment is None:
    return None
  names = [t.name for t in tools] + (environment_methods(environment) if environment else [])
  twice = sorted({n for n in names if names.count(n) > 1})
  if twice:
    raise ToolError(f"config.rl.tools / config.rl.environment: two tools are named "
                    f"{twice[0]!r}; the model calls a tool by its name, so each needs its "
                    f"own (tools: {names}).")
  box = Toolbox(tuple(tools), environment)
  box.schemas  # noqa: B018  (each method's schema is checked here)
  if environment is not None and not environment_methods(environment) and not tools:
    raise ToolError(f"config.rl.environment={environment_spec!r}: the class "
                    f"{environment.__name__} has no public methods, so the model has no "
                    f"tool to call; define its tools as methods.")
  return box


def call(functions: Mapping[str, Callable], schemas: Mapping[str, dict], name: str,
         arguments: Mapping[str, Any]) -> tuple[str, bool]:
  """One tool call's result as the tool turn's text, and whether it succeeded: `str(result)`;
  a raise is `str({"error": message})`, and an unknown name `Tool NAME not found.` as an
  error (TRL's). Arguments are typed by the tool's schema (`"7"` is 7 for an integer)."""
  if name not in functions:
    return str({"error": f"Tool {name} not found."}), False
  try:
    result = functions[name](**typed(arguments, schemas.get(name)))
    if inspect.isawaitable(result):  # An async tool (as TRL takes them): run to its end.
      result = asyncio.run(_awaited(result))
    return str(result), True
  except Exception as e:  # A tool's failure is the model's to see, not the run's.
    return str({"error": str(e)}), False


async def _awaited(awaitable):
  return await awaitable


def typed(arguments: Mapping[str, Any], schema: dict | None) -> dict[str, Any]:
  """Arguments whose schema says integer, number or boolean, written as text, as values."""
  if not schema:
    return dict(arguments)
  properties = schema["function"]["parameters"].get("properties", {})
  out = {}
  for key, value in arguments.items():
    kind = properties.get(key, {}).get("type")
    if isinstance(value, str) and kind in ("integer", "number", "boolean"):
      try:
        parsed = json.loads(value)
      except ValueError:
        parsed = value
      ok = {"integer": int, "number": int | float, "boolean": bool}[kind]
      if isinstance(parsed, ok) and (kind == "boolean" or not isinstance(parsed, bool)):
        value = parsed
    out[key] = value
  return out
