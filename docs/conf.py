"""Sphinx configuration of the docs site.

Sphinx with MyST Markdown pages, as flax, optax and orbax build theirs: the
guides are Markdown, the MNIST ensemble is a MyST notebook that myst-nb
executes on every build, and the API reference is generated from the
docstrings (autosummary + autodoc, Google style through napoleon). Build it
(with warnings as errors, as the tests do) with the command in the README.
"""

import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "docs" / "_ext"))

# The notebook prepares MNIST with TFDS: offline from the four IDX files that the docs
# command names (`TFDS_MANUAL_DIR=../shared/data/mnist`, as the README's first command
# names them), else by download. The README's commands run from the repository root, and
# Sphinx reads this file from docs/ and runs the notebook in docs/notebooks/, so a
# relative directory is taken from the repository root.
if os.environ.get("TFDS_MANUAL_DIR"):
  os.environ["TFDS_MANUAL_DIR"] = str(ROOT / os.path.expanduser(os.environ["TFDS_MANUAL_DIR"]))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

project = "flax-trainer"
author = "the flax-trainer developers"
copyright = "2026, the flax-trainer developers"  # noqa: A001 (Sphinx's name)

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "api_coverage",
    "prose_attributes",
]

source_suffix = {".rst": "restructuredtext", ".md": "myst-nb"}
exclude_patterns = ["_build", "jupyter_execute", "**.ipynb_checkpoints"]
templates_path = ["_templates"]

# -- MyST and the executed notebook --------------------------------------------------
myst_heading_anchors = 3  # `[text](page.md#a-heading)` links resolve, and fail when broken.
myst_enable_extensions = ["colon_fence"]
nb_execution_mode = "force"  # The MNIST ensemble runs on every build.
nb_execution_timeout = 900
nb_execution_raise_on_error = True  # A cell that fails fails the build.
nb_execution_show_tb = True
nb_merge_streams = True

# -- The API reference ---------------------------------------------------------------
autosummary_generate = True
autosummary_ignore_module_all = True
autodoc_member_order = "bysource"  # The Trainer's hooks in the order the class gives them.
autodoc_typehints = "description"  # Types beside each argument; signatures stay readable.
autodoc_default_options = {"show-inheritance": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_attr_annotations = False  # Dataclass fields show their annotation once, in autodoc.
default_role = "code"  # Docstrings write `name` for code.

# Broken references to this project's own objects are errors (nitpicky, with -W); names
# from the libraries it builds on are not resolved (no intersphinx: the build runs
# offline), so they are let through by package.
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(jax|jaxlib|jnp|np|numpy|flax|nn|nnx|optax|ml_collections|clu|clu_metrics|"
               r"metric_writers|orbax|ocp|tf|tfds|tensorflow_datasets|grain|etils|epath|"
               r"collections|typing|abc|types|os|inspect|dataclasses|contextlib|threading|"
               r"signal|argparse|pathlib|subprocess|enum|optuna|lm_eval)(\..*)?"),
    (r"py:.*", r"(Any|Callable|Iterable|Iterator|Mapping|Sequence|PyTree|Batch|Inputs|Rngs|"
               r"StepFn|InitFn|Schedule|Advance|GradFn|LossFn|Flat|Source|Path|TrainData|"
               r"MemberOptimizer|T|Self|PartitionSpec|Mesh|NamedSharding|Sharding|"
               r"Device|Array|ShapeDtypeStruct|ArrayTree|_ReductionCounter|.*<locals>.*)"),
    (r"py:.*", r"(int|float|str|bool|dict|list|tuple|set|None|object|type|bytes|slice|"
               r"Exception|ValueError|RuntimeError|FloatingPointError|KeyError|TypeError|"
               r"AttributeError|OSError|ImportError|property|classmethod|staticmethod)"),
]

# -- HTML ----------------------------------------------------------------------------
html_theme = "sphinx_book_theme"
html_title = "flax-trainer"
html_theme_options = {
    "show_toc_level": 2,
    # The sidebar lists every page, and expands only the branch of the page shown: with
    # all ~110 API pages expanded in every page's sidebar, writing the site took 78 s of
    # a build without the notebook on a 2-core EPYC, against 51 s collapsed.
    "collapse_navbar": True,
    "repository_url": "",
    "use_repository_button": False,
}
