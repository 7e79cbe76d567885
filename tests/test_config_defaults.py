"""Each config default is declared once, in `configs/base.py`: the library reads every field
it uses without a fallback, and every such field is declared there."""

import ast
import pathlib

import pytest

from configs import base

ROOT = pathlib.Path(__file__).resolve().parents[1]
LIBRARY = sorted(p for d in ("trainer", "strategies") for p in (ROOT / d).rglob("*.py"))
#: Sections a setup config declares for its own task (model and dataset; the LM setup's
#: `seq_len`, which the dry run's LM entry reads; post-training's `preference`, `rl` and
#: `distill`, which `configs/preference.py`, `configs/rl.py` and `configs/distill.py` declare),
#: read by task Trainers and
#: entry points; everything else the library reads is a base field.
SETUP_SECTIONS = ("model", "data", "seq_len", "preference", "rl", "distill")
CONFIG_DICT_METHODS = {"get", "update", "to_dict", "items", "keys", "values", "get_ref",
                       "lock", "unlock", "copy_and_resolve_references", "to_json",
                       "to_json_best_effort"}


def _config_reads(path: pathlib.Path) -> list[tuple[int, str, bool]]:
  """`(line, dotted field, read with .get)` of every `config.x.y` chain in a module's code."""
  reads = []
  tree = ast.parse(path.read_text())
  inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
  for node in ast.walk(tree):
    if not isinstance(node, ast.Attribute) or id(node) in inner:
      continue  # Only the outermost attribute of a chain.
    names, value = [], node
    while isinstance(value, ast.Attribute):
      names.append(value.attr)
      value = value.value
    root_is_config = (isinstance(value, ast.Name) and value.id == "config") or bool(
        names and names[-1] == "config")
    if not root_is_config:
      continue
    names = names[::-1]
    if names and names[0] == "config":
      names = names[1:]  # `self.config.x`.
    via_get = bool(names) and names[-1] == "get"
    while names and names[-1] in CONFIG_DICT_METHODS:
      names = names[:-1]
    if names:
      reads.append((node.lineno, ".".join(names), via_get))
  for node in ast.walk(tree):  # `config.get("field", fallback)`, `config.x.get("y", ...)`.
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        and node.func.attr == "get" and node.args and isinstance(node.args[0], ast.Constant)):
      names, value = [], node.func.value
      while isinstance(value, ast.Attribute):
        names.append(value.attr)
        value = value.value
      names = names[::-1]
      if isinstance(value, ast.Name) and value.id == "config" or names[:1] == ["config"]:
        names = [n for n in names if n != "config"] + [str(node.args[0].value)]
        reads.append((node.lineno, ".".join(names), True))
  return reads


def test_a_read_with_a_fallback_is_found():
  import tempfile
  with tempfile.NamedTemporaryFile("w", suffix=".py") as f:
    f.write("def f(config):\n  return config.get('num_cpu_devices', 0) or 8\n")
    f.flush()
    assert _config_reads(pathlib.Path(f.name)) == [(2, "num_cpu_devices", True)]


READS = [(p.relative_to(ROOT), line, field, via_get)
         for p in LIBRARY for line, field, via_get in _config_reads(p)]


def test_the_library_reads_config_fields():
  fields = {field for _, _, field, _ in READS}
  assert {"batch_size", "strategy.name", "schedule.warmup_steps", "checkpoint.keep_best",
          "mixed_precision.compute_dtype", "sync_batchnorm"} <= fields, sorted(fields)


def test_no_library_read_has_a_fallback_default():
  assert not [f"{p}:{line} config.{field}.get" for p, line, field, via_get in READS if via_get]


@pytest.mark.parametrize("field", sorted({f for _, _, f, _ in READS
                                          if f.split(".")[0] not in SETUP_SECTIONS}))
def test_every_field_the_library_reads_is_declared_in_configs_base(field):
  node = base.get_config()
  for part in field.split("."):
    assert part in node, f"config.{field} is read by the library but not declared in " \
                         f"configs/base.py"
    node = node[part]
