r"""The shape of the code, side by side with an earlier revision: class and function sizes,
the Trainer's layout (its hooks come before `__init__`), the longest function on a run's
path (`Trainer.fit`, `trainer/run/`, the loop's driver; docstrings included), import cycles,
config fields read with a fallback default, and the layout of `trainer/`.

    python benchmarks/structure.py --before ad45b18

Reads source files only (no jax): the working tree against `git archive` of `--before`.
"""

from __future__ import annotations

import argparse
import ast
import collections
import io
import pathlib
import re
import subprocess
import tarfile
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("trainer", "strategies")


def _files(root: pathlib.Path) -> list[pathlib.Path]:
  return sorted(p for d in PACKAGES for p in (root / d).rglob("*.py"))


def _module(root: pathlib.Path, path: pathlib.Path) -> str:
  name = ".".join(path.relative_to(root).with_suffix("").parts)
  return name.removesuffix(".__init__")


def _cycles(root: pathlib.Path) -> list[tuple[str, ...]]:
  """Cycles in the import graph of the project's modules (any import, top-level or not)."""
  modules = {_module(root, p): p for p in _files(root)}
  graph = collections.defaultdict(set)
  for name, path in modules.items():
    for node in ast.walk(ast.parse(path.read_text())):
      targets = []
      if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom) and node.module:
        targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
      graph[name].update(t for t in targets
                         if t in modules and t != name and not name.startswith(t + "."))
  found = set()

  def walk(start, node, path):
    for nxt in graph[node]:
      if nxt == start:
        found.add(tuple(sorted(path)))
      elif nxt not in path and len(path) < 6:
        walk(start, nxt, [*path, nxt])

  for name in modules:
    walk(name, name, [name])
  return sorted(found)


#: The modules a run goes through once `Trainer.fit` hands it on (and `Trainer.fit` itself).
RUN_PATH = ("trainer/run/", "trainer/loop/driver.py")


def _size(node: ast.AST) -> int:
  return node.end_lineno - node.lineno + 1


def _trainer_layout(root: pathlib.Path) -> tuple[int, int, str]:
  """`(methods before __init__, methods, fit's size)` of the Trainer class."""
  tree = ast.parse((root / "trainer" / "trainer.py").read_text())
  cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Trainer")
  methods = [n for n in cls.body if isinstance(n, ast.FunctionDef)]
  first = next(i for i, m in enumerate(methods) if m.name == "__init__")
  return first, len(methods), next(_size(m) for m in methods if m.name == "fit")


def measure(root: pathlib.Path) -> dict[str, str]:
  classes, functions, run_path = [], [], []
  for path in _files(root):
    on_run_path = any(str(path.relative_to(root)).startswith(p) for p in RUN_PATH)
    for node in ast.walk(ast.parse(path.read_text())):
      size = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
      if isinstance(node, ast.ClassDef):
        methods = sum(isinstance(n, ast.FunctionDef) for n in node.body)
        classes.append((size, methods, node.name))
      elif isinstance(node, ast.FunctionDef):
        functions.append((size, node.name))
        if on_run_path:
          run_path.append((size, f"{path.relative_to(root)}:{node.name}"))
  before_init, trainer_methods, fit = _trainer_layout(root)
  run_path.append((fit, "Trainer.fit"))
  by_name = {name: (size, methods) for size, methods, name in classes}
  fallbacks = sum(len(re.findall(r"\b(?:config|c|s|mp|early|profile)\.get\(", p.read_text()))
                  for p in _files(root) + sorted((root / "examples").glob("*.py")))
  top = sorted(p.name for p in (root / "trainer").glob("*.py"))
  packages = sorted(p.name for p in (root / "trainer").iterdir() if (p / "__init__.py").exists())
  size, methods, name = max(classes)
  fn_size, fn_name = max(functions)
  return {
      "Trainer class (lines, methods)": "{} lines, {} methods".format(*by_name["Trainer"]),
      "Trainer methods before __init__": f"{before_init} of {trainer_methods}",
      "run path: longest function": "{1}: {0} lines".format(*max(run_path)),
      "largest class": f"{name}: {size} lines, {methods} methods",
      "largest function": f"{fn_name}: {fn_size} lines",
      "Strategy base (lines, methods)": "{} lines, {} methods".format(*by_name["Strategy"]),
      "import cycles": str(len(_cycles(root))),
      "config.get(field, default) reads": str(fallbacks),
      "trainer/ top-level modules": str(len(top)),
      "trainer/ sub-packages": ", ".join(packages) or "none",
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--before", default="ad45b18",
                      help="the git revision to compare with (default: before issue 9)")
  args = parser.parse_args()
  archive = subprocess.run(["git", "archive", args.before, *PACKAGES, "examples"], cwd=ROOT,
                           capture_output=True)
  after = measure(ROOT)
  if archive.returncode:  # E.g. a shallow clone without that revision.
    print(f"revision {args.before} is not in this clone: {archive.stderr.decode().strip()}")
    before = dict.fromkeys(after, "n/a")
  else:
    with tempfile.TemporaryDirectory() as before_root:
      tarfile.open(fileobj=io.BytesIO(archive.stdout)).extractall(before_root, filter="data")
      before = measure(pathlib.Path(before_root))
  width = max(map(len, after))
  print(f"{'':{width}}  {args.before:<34}  working tree")
  for key, value in after.items():
    print(f"{key:{width}}  {before[key]:<34}  {value}")


if __name__ == "__main__":
  main()
