"""The README's commands are the ones CI runs."""

import pathlib
import re

import doc_commands

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command_exactly():
  commands = doc_commands.commands()
  test_commands = [c for c in commands if doc_commands.is_test_command(c)]
  assert len(test_commands) == 1, commands
  ci_script = (ROOT / ".ci" / "run").read_text().splitlines()
  assert test_commands[0] in ci_script


def test_ci_names_the_cpu_and_its_vector_extensions_first():
  import subprocess
  lines = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
           if line and not line.startswith(("#", "set ", "cd "))]
  assert lines[0].startswith("bash .ci/cpu"), lines[:2]
  printed = subprocess.run(["bash", str(ROOT / ".ci" / "cpu")], capture_output=True, text=True,
                           check=True).stdout
  cpuinfo = pathlib.Path("/proc/cpuinfo").read_text()
  model = next(line.split(":", 1)[1].strip() for line in cpuinfo.splitlines()
               if line.startswith("model name"))
  flags = next(line.split(":", 1)[1].split() for line in cpuinfo.splitlines()
               if line.startswith("flags"))
  assert printed.startswith(f"CPU: {model} ("), printed
  listed = printed.split("vector extensions:", 1)[1].split()
  assert listed and set(listed) <= set(flags), printed
  assert ("avx512f" in listed) == ("avx512f" in flags), printed


# The JAX-stack packages whose next minor release may change APIs the project uses, and the
# newest release of each that the code is written for, which the declared range must admit.
NEWEST_ADMITTED = {"jax": "0.12.0", "jaxlib": "0.12.0", "flax": "0.12.12", "optax": "0.2.8",
                   "orbax-checkpoint": "0.12.8"}


def test_jax_stack_dependencies_are_bounded_and_hold_the_installed_versions():
  import importlib.metadata
  import tomllib

  from packaging.requirements import Requirement
  from packaging.version import Version

  project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  requirements = {Requirement(r).name: Requirement(r) for r in project["dependencies"]}
  for name, newest in NEWEST_ADMITTED.items():
    spec = requirements[name].specifier
    installed = Version(importlib.metadata.version(name))
    upper = [s for s in spec if s.operator == "<"]
    assert upper, f"{name} has no upper bound in pyproject.toml: {spec}"
    bound, newest = Version(upper[0].version), Version(newest)
    # Admits the newest release written for, and stops below the minor after it.
    assert newest in spec, (name, str(spec), str(newest))
    assert (bound.major, bound.minor) == (newest.major, newest.minor + 1), (name, str(spec))
    assert installed in spec, f"installed {name} {installed} is outside {spec}"


#: The extras that name what a part of the product needs: a module only they install is
#: imported where that part runs (`test` and `docs` are for checking the product only).
PRODUCT_EXTRAS = ("eval", "wandb", "reasoning")


def test_every_third_party_module_the_product_imports_is_declared():
  """`pip install -e .` (plus the extra that documents a part) installs every distribution
  the product's code imports: the packages, the configs and the examples."""
  import ast
  import importlib.metadata
  import sys
  import tomllib

  from packaging.requirements import Requirement
  from packaging.utils import canonicalize_name

  project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  extras = project["optional-dependencies"]
  declared = {canonicalize_name(Requirement(r).name) for r in project["dependencies"]}
  declared |= {canonicalize_name(Requirement(r).name) for extra in PRODUCT_EXTRAS
               for r in extras[extra]}
  ours = {"trainer", "strategies", "models", "configs", "examples", "__future__"}
  ours |= {p.stem for p in (ROOT / "examples").glob("*.py")}  # Siblings an example imports.
  imported = {}
  for top in ("trainer", "strategies", "models", "configs", "examples"):
    for path in (ROOT / top).rglob("*.py"):
      for node in ast.walk(ast.parse(path.read_text())):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module] if isinstance(node, ast.ImportFrom) and not node.level else [])
        for name in names:
          root = name.split(".")[0]
          if root not in sys.stdlib_module_names and root not in ours:
            imported.setdefault(root, path.relative_to(ROOT))
  distributions = importlib.metadata.packages_distributions()
  missing = {f"{module} ({distributions.get(module)}, imported by {where})"
             for module, where in imported.items()
             if not {canonicalize_name(d) for d in distributions.get(module, [module])}
             & declared}
  assert len(imported) > 15 and not missing, sorted(missing)


# -- What the docs say of the code, checked against it --------------------------------------

def _docstring_families(text):
  import re
  return set(re.findall(r"`(gpt2|llama|mistral|qwen2|qwen3|mixtral|qwen3_moe)`", text))


def test_every_list_of_the_families_names_all_that_export():
  from trainer.interop import families
  every = set(families.FAMILIES)
  assert len(every) == 7
  for path in ("trainer/export.py", "configs/finetune_lm.py"):
    named = _docstring_families((ROOT / path).read_text())
    assert named == every, f"{path} names {sorted(named)}, not every family {sorted(every)}"


def test_the_moe_guide_names_the_routers_axes_as_the_code_annotates_them():
  import re

  import flax.linen as nn
  import jax
  import jax.numpy as jnp

  from models.moe import MoeMlp
  module = MoeMlp(mlp_dim=8, num_experts=4)
  abstract = jax.eval_shape(module.init, jax.random.PRNGKey(0), jnp.zeros((1, 2, 6)))
  names = tuple(nn.get_partition_spec(abstract)["params"]["router"])
  guide = (ROOT / "docs" / "guides" / "moe.md").read_text()
  (said,) = re.findall(r"`router \[([^\]]+)\]`", guide)
  assert tuple(None if n.strip() == "None" else n.strip() for n in said.split(",")) == names


def test_the_guides_say_predict_returns_probabilities():
  guides = "\n".join(p.read_text() for p in (ROOT / "docs").rglob("*.md"))
  assert "`trainer.predict(state, batch)` returns" in guides
  said = guides.split("`trainer.predict(state, batch)` returns", 1)[1][:300]
  assert "probabilities" in said and "not logits" in said


def test_the_readme_is_a_front_door():
  # What it is, the two commands, a short example, links; the detail is in the guides.
  lines = (ROOT / "README.md").read_text().splitlines()
  assert len(lines) < 250, f"README.md has {len(lines)} lines"


#: The pages a user reads: the README and every page of the docs.
PAGES = (ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")))


def test_the_docs_are_references_not_logs():
  """No page cites the tracker's issues (git keeps the history), the README's setup holds
  no suite timings, and the testing guide is a guide, not a diary of runs."""
  cited = [f"{page.relative_to(ROOT)}: {m.group(0)!r}" for page in PAGES
           if "_build" not in page.parts
           for m in re.finditer(r"\bissues? [\"']?\d+", page.read_text())]
  assert not cited, cited
  readme = (ROOT / "README.md").read_text()
  assert not re.search(r"\bcold\b|\bwarm\b|slowest tests", readme)
  testing = (ROOT / "docs" / "guides" / "testing.md").read_text().splitlines()
  assert len(testing) < 200, len(testing)
  assert not re.search(r"calibration|\bpairing\b|fresh clones? of", "\n".join(testing))


def test_the_structure_tables_show_the_source_as_it_is():
  """The architecture page's "now" column is what `benchmarks/structure.py`
  measures in this tree (the Trainer's size is the figure a new method or flag would move)."""
  import importlib.util
  spec = importlib.util.spec_from_file_location("structure", ROOT / "benchmarks" / "structure.py")
  structure = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(structure)
  now = structure.measure(ROOT)
  rows = {"`Trainer` (lines, methods)": now["Trainer class (lines, methods)"],
          "methods before `__init__` (the hooks)": now["Trainer methods before __init__"],
          "longest function on the run path": re.sub(
              r"^(\S+):", r"`\1`:", now["run path: longest function"]),
          "import cycles": now["import cycles"]}
  page = ROOT / "docs" / "architecture.md"
  table = dict(re.findall(r"^\| ([^|]+?) \| ([^|]+?) \|$", page.read_text(), flags=re.M))
  assert {row: table.get(row) for row in rows} == rows, page.name


def test_no_library_module_grows_past_500_lines():
  # Issue 25 split the files over 500 lines along their seams; a module that grows past it
  # is split the same way (a part of its own), not left to grow.
  sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines())
           for d in ("trainer", "strategies", "models", "configs")
           for p in (ROOT / d).rglob("*.py")}
  assert len(sizes) > 50 and {p: n for p, n in sizes.items() if n > 500} == {}


def test_no_program_sets_its_device_count_through_xla_flags():
  # `os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=N")` is lost
  # when a user's shell holds any XLA_FLAGS of its own: the long-context benchmark then ran
  # on one device and refused its mesh. Programs set the count with
  # `trainer.distributed.devices.set_num_cpu_devices` (jax's `jax_num_cpu_devices`).
  programs = [p for d in ("trainer", "strategies", "models", "configs", "examples", "benchmarks")
              for p in (ROOT / d).rglob("*.py")]
  assert len(programs) > 80
  assert [str(p.relative_to(ROOT)) for p in programs
          if "xla_force_host_platform_device_count" in p.read_text()] == []
