"""Test setup: 8 fake CPU devices (set before jax initialises) and small trainers."""

import collections
import dataclasses
import fcntl
import functools
import gc
import json
import os
import pathlib
import platform
import re
import subprocess
import sys
import tempfile
import time

#: XLA:CPU options of the tests alone. LLVM's optimisation level 0 for the backend (XLA's
#: own HLO passes, fusion among them, still run; LLVM selects instructions with FastISel and
#: allocates registers with its fast allocator). The tests' shapes are tiny, so what level 0
#: saves in compiling outweighs its slower code: from an empty cache the whole suite took
#: 2064 worker-seconds against 2381 at level 1 (its programs compiled in 466 s against
#: 712 s; `test_context.py`'s eight layout checks alone 44 CPU-seconds against 66), every
#: check still passing. Level 1 had itself compiled in about 0.8 of XLA's default, 3.
#: (When first tried, before `OPTIONAL_XLA_FLAGS`, level 0 moved the last bit of one
#: parameter in a bitwise steps-per-call check; with them every bitwise check holds.) A loop
#: whose body XLA emits itself runs slowest: the 4-members-on-one-device `map` ensemble's
#: step took 2.8 s against 0.05 s, 11 s in all (`test_ensemble.py`). XLA's element-wise
#: emitters instead of its newer MLIR fusion emitters (`OPTIONAL_XLA_FLAGS`) compiled the
#: programs of `test_steps_per_call.py`, `test_context.py` and `test_equivalence.py` in
#: 209 s against 253 s from an empty cache, with every bitwise check still equal. Each
#: equivalence compares programs compiled with the same options and takes its tolerance
#: from the computation (`numerics.py`), so it still holds; the documented commands run
#: without these options (`doc_commands.Runner`), as a user runs them.
TEST_XLA_FLAGS = ("--xla_force_host_platform_device_count=8",
                  "--xla_backend_optimization_level=0")
#: Options a later jaxlib may no longer know (XLA aborts on an unknown flag): used where
#: this jaxlib starts with them and compiles with them. On x86-64, code for AVX at most (no
#: FMA, no AVX2, whatever the CPU has): LLVM compiled the transformer LM's four layout tests
#: in 31.4 s against 41.2 s (`test_moe.py`'s expert layouts 65.1 s against 70.2 s,
#: `test_steps_per_call.py` 159 s against 165 s), every bitwise check still equal, and
#: XLA emits the same code for them on an AVX2, AVX-512 or AMX machine. Matrix
#: products and convolutions run in XLA's precompiled libraries, which pick their own
#: instructions, so the warm suite runs as fast (`test_moe.py`'s four: 49.4 s against 48.0 s).
OPTIONAL_XLA_FLAGS = ("--xla_cpu_use_fusion_emitters=false",
                      *(("--xla_cpu_max_isa=AVX",) if platform.machine() in ("x86_64", "AMD64")
                        else ()))
_PROBED = "FLAX_TRAINER_TEST_XLA_FLAGS"  # Set once probed: xdist workers inherit it.


def _known_to_xla(flags: tuple[str, ...]) -> tuple[str, ...]:
  """The flags with which this jaxlib starts and compiles a program, each tried alone."""
  def compiles_with(flag):
    return subprocess.run(
        [sys.executable, "-c", "import jax; jax.jit(lambda x: x + 1)(1.0).block_until_ready()"],
        capture_output=True, env={**os.environ, "XLA_FLAGS": flag, "JAX_PLATFORMS": "cpu"}
    ).returncode == 0

  if _PROBED not in os.environ:
    os.environ[_PROBED] = " ".join(f for f in flags if compiles_with(f))
  return tuple(os.environ[_PROBED].split())


_flags = os.environ.get("XLA_FLAGS", "").split()
os.environ["XLA_FLAGS"] = " ".join(
    _flags + [f for f in (*TEST_XLA_FLAGS, *_known_to_xla(OPTIONAL_XLA_FLAGS))
              if f not in _flags])
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# XLA:CPU's thread pool sized for the 8 devices' collectives (`reserve_host_threads`): at
# its default size, a test whose devices waited in collectives filled it, and XLA aborted the
# worker ("Termination timeout ... only 7 of them arrived"). Before jax starts; processes
# the tests launch inherit it, and documented commands set it themselves.
from trainer.distributed.devices import reserve_host_threads  # noqa: E402

reserve_host_threads(8)
# JAX's persistent compilation cache, shared by every xdist worker and every subprocess the
# tests start (README commands, launched processes inherit the environment): the same
# programs (a CNN step under a strategy, an example's eval step) compile once per machine.
# Entries are keyed by the program, jax version and compile options, so a stale one is
# never used. Every program is kept, however fast it compiled: the tests compile thousands
# of small ones, and reading one back is faster than compiling it again (with programs
# under 0.1 s left out, transformer, LoRA and plan tests took 66.6 s warm; with all kept,
# 58.6 s).
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(tempfile.gettempdir(), "flax_trainer_tests_jax_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# Python's cyclic collector, in the test processes only. A worker holds about 700,000
# objects once jax, TensorFlow, torch and transformers are imported, and each full
# collection walks them all: at Python's thresholds (700, 10, 10) collection took 7.6 s of
# a 105 s run of six files (5,400 young collections, 22 full ones at 0.3 s each). Young
# collections every 10,000 allocations instead of 700 (so full ones a tenth as often), and
# what the imports and collection made frozen out of every later walk
# (`pytest_collection_finish`): GC_THRESHOLDS. The collector still runs, and
# `_release_programs` still collects between files.
GC_THRESHOLDS = (10_000, 10, 10)
gc.set_threshold(*GC_THRESHOLDS)

import doc_commands  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_collections  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow_datasets as tfds  # noqa: E402
from tensorflow_datasets.testing import mocking as tfds_mocking  # noqa: E402

import models  # noqa: E402
from configs import mlp_sharded, mnist_ensemble  # noqa: E402
from trainer import ClassificationTrainer, Trainer  # noqa: E402
from trainer import data as data_lib  # noqa: E402

NUM_DEVICES = 8

#: Overrides for jit data parallelism on a 1-D mesh of the 8 devices.
SHARDED_8 = {"strategy.name": "sharded_data_parallel", "strategy.mesh_shape": (8,),
             "strategy.mesh_axes": ("data",), "strategy.logical_axis_rules": (("batch", "data"),)}

#: Overrides for each of the five strategies on the 8 devices (ensembles: 8 members one per
#: device, and 4 members each split over 2 data devices).
ALL_STRATEGIES = {
    "single_device": {},
    "pmap_data_parallel": {"strategy.name": "pmap_data_parallel"},
    "sharded_data_parallel": SHARDED_8,
    "pmap_ensemble": {"strategy.name": "pmap_ensemble", "ensemble_size": 8},
    "sharded_ensemble": {"strategy.name": "sharded_ensemble", "ensemble_size": 4,
                         "strategy.ensemble_mesh_shape": (2, 4)},
}


class CNNTrainer(ClassificationTrainer):
  def build_model(self):
    return models.CNN(num_classes=10)


class MLPTrainer(Trainer):
  """Regression with the logical-axis MLP: mean squared error per example."""

  def build_model(self):
    return models.MLP(num_layers=self.config.model.num_layers, depth=self.config.model.depth)

  def loss(self, outputs, batch):
    return jnp.mean((outputs - batch["targets"]) ** 2, axis=-1)


def xla_flags_naming_no_level() -> str:
  """The tests' XLA_FLAGS less the optimisation level: a user's process that names none,
  whose init and dry-run programs take the product's own level
  (`strategies.base.cpu_compiler_options`)."""
  return re.sub(r"--xla_backend_optimization_level=\S+", "", os.environ["XLA_FLAGS"])


def cnn_config(**overrides) -> ml_collections.ConfigDict:
  config = mnist_ensemble.get_config()
  config.strategy.name = "single_device"
  config.batch_size = 16
  config.eval_batch_size = 16
  config.learning_rate = 0.05
  config.log_every_steps = 1000
  config.update_from_flattened_dict(overrides)
  return config


def mlp_config(**overrides) -> ml_collections.ConfigDict:
  config = mlp_sharded.get_config()
  config.model.num_layers = 2
  config.model.depth = 16
  config.model.embed = 8
  config.batch_size = 16
  config.eval_batch_size = 16
  config.log_every_steps = 1000
  config.update_from_flattened_dict(overrides)
  return config


def image_batches(num: int, batch_size: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
  """Random 28x28 images; the label is the quadrant with the most ink, so it is learnable."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(num):
    images = rng.random((batch_size, 28, 28, 1), dtype=np.float32)
    quadrants = images.reshape(batch_size, 2, 14, 2, 14).sum(axis=(2, 4)).reshape(batch_size, 4)
    out.append({"image": images, "label": quadrants.argmax(-1).astype(np.int32)})
  return out


def vector_batches(num: int, batch_size: int, dim: int, seed: int = 0):
  rng = np.random.default_rng(seed)
  return [{"inputs": rng.normal(size=(batch_size, dim)).astype(np.float32),
           "targets": rng.normal(size=(batch_size, dim)).astype(np.float32)}
          for _ in range(num)]


class _BoundDataSourceMock(tfds_mocking.PickableDataSourceMock):
  """TFDS 4.9's `mock_data` sets its array_record data source's `__getitems__` as an
  instance attribute, a function of `(self, record_keys)`, so calling it passes no `self`;
  this mock binds it (the pipelines that read many records at once call it)."""

  def __setattr__(self, name, value):
    if name == "__getitems__":
      value = functools.partial(value, self)
    super().__setattr__(name, value)


def mock_tfds(num_examples: int):
  """`tfds.testing.mock_data(num_examples)`, whose data sources also read several records
  in one call, as the in-memory and device pipelines do from array_record data."""
  return tfds.testing.mock_data(num_examples=num_examples,
                                mock_array_record_data_source=_BoundDataSourceMock())


def leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


@pytest.fixture(scope="session", autouse=True)
def _eight_devices():
  assert jax.device_count() == NUM_DEVICES, "fake CPU devices were not configured"


# -- The documented commands (tests/doc_commands.py) ------------------------------------------


@pytest.fixture(scope="session")
def doc_runner(tmp_path_factory):
  """Runs documented commands under one root, shared by the workers of `pytest -n` (xdist)."""
  base = tmp_path_factory.getbasetemp()
  root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "doc_commands"
  root.mkdir(exist_ok=True)
  return doc_commands.Runner(root=root)


@dataclasses.dataclass
class RealMnistRun:
  command: str  # The README line.
  result: subprocess.CompletedProcess
  workdir: pathlib.Path


@pytest.fixture(scope="session")
def real_mnist_run(doc_runner) -> RealMnistRun:
  """The README's first command on the real MNIST files, 50 steps (evaluated on 2,000 test
  images), once per session.

  Installing is what CI's own `.ci/run` does; this runs what the command
  then runs: the flagship example with `--config.data.manual_dir` pointing at
  the IDX files, so TFDS prepares MNIST from them (into the runner's home's
  `~/tensorflow_datasets`, which the README's later commands then read).
  """
  if not all((doc_commands.MNIST_DIR / f).is_file()
             for f in data_lib.MNIST_FILES):
    if os.environ.get("CI") == "true":
      pytest.fail(f"the real MNIST files are missing from {doc_commands.MNIST_DIR}; CI "
                  f"must run the README's first command on them")
    pytest.skip(f"real MNIST files not found in {doc_commands.MNIST_DIR}")
  command = next(c for c in doc_commands.commands() if "pip install" in c
                 and doc_commands.script_of(c) == "examples/mnist_ensemble.py")
  workdir = doc_runner.path(re.search(r"--workdir=/tmp/(\S+)", command).group(1))
  # Under `pytest -n`, the first worker to get here runs it; the others wait and read its result.
  with open(doc_runner.root / "real_mnist.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    saved = doc_runner.root / "real_mnist.json"
    if saved.exists():
      result = subprocess.CompletedProcess(**json.loads(saved.read_text()))
    else:
      # Its evaluation on the test split's first 2,000 images (as the docs' notebook's):
      # all 10,000 took 15 s of its 134 s.
      result = doc_runner.run(command, extra=["--config.num_train_steps=50",
                                                 "--config.log_every_steps=25",
                                                 "--config.data.eval_split=test[:2000]"])
      saved.write_text(json.dumps({"args": result.args, "returncode": result.returncode,
                                   "stdout": result.stdout, "stderr": result.stderr}))
  return RealMnistRun(command, result, workdir)


# -- Order: a file to a worker, most tests first, a few long files before them ----------------

#: Files whose few tests take minutes. `pytest -n 2 --dist loadfile` hands whole files to
#: the workers in collection order (`pytest_configure`): these first, then the rest by their
#: number of tests, most first (xdist's own order, which measured faster here than longest
#: first: 14:53 against 15:47 from a fresh clone with an empty compilation cache, as it runs
#: the long multi-process files beside short ones rather than two at once on 2 cores). By
#: count alone the docs build (5 tests, 140 s) came last, and the worker that drew it ran it
#: alone at the end: one worker ended 83 s after the other in a warm run of df08c47.
FIRST = ("test_docs.py",)
#: The file whose test runs the README's first command itself (`real_mnist_run`).
REAL_MNIST_FILE = "test_doc_commands_mnist.py"


def pytest_configure(config):
  # pytest-xdist (3.6+) reorders files by their number of tests unless told not to: the
  # order is `pytest_collection_modifyitems`', which counts the same way with FIRST first.
  if hasattr(config.option, "loadscopereorder"):
    config.option.loadscopereorder = False


# -- Where the suite's time goes: FLAX_TRAINER_TIME_REPORT=<dir> (opt-in) --------------------

#: Per test file: its tests' wall seconds, and the programs XLA compiled for them (count and
#: seconds) or read from the persistent cache, in this pytest process (not in the
#: subprocesses its tests start). Each process writes `<dir>/<worker>.json`; the controller
#: merges them into `<dir>/report.md`.
_TIME_REPORT = os.environ.get("FLAX_TRAINER_TIME_REPORT")
_CURRENT_FILE = ["(collection)"]
_TIMES: dict = {}
_TESTS: dict = {}  # Each test's wall seconds, by its node id.


def _count(key: str, value: float = 1.0) -> None:
  entry = _TIMES.setdefault(_CURRENT_FILE[0], {})
  entry[key] = entry.get(key, 0.0) + value


_CURRENT_TEST = ["(collection)"]
#: By test node id, then program name: [times compiled or read back, their seconds]. The
#: report's totals by name are their sums.
_TEST_PROGRAMS: dict = {}


def _compiled(seconds: float, fun_name: str = "?") -> None:
  _count("compile_s", seconds)
  _count("compiled")
  entry = _TEST_PROGRAMS.setdefault(_CURRENT_TEST[0], {}).setdefault(fun_name, [0, 0.0])
  entry[0] += 1
  entry[1] += seconds


if _TIME_REPORT:
  jax.monitoring.register_event_duration_secs_listener(
      lambda event, seconds, **kw: _compiled(seconds, kw.get("fun_name", "?"))
      if event == "/jax/core/compile/backend_compile_duration" else None)
  jax.monitoring.register_event_listener(
      lambda event, **_: _count("cache_hits")
      if event == "/jax/compilation_cache/cache_hits" else None)


def _memory_maps() -> int:
  """This process's memory mappings (Linux; 0 elsewhere)."""
  try:
    with open("/proc/self/maps") as f:
      return sum(1 for _ in f)
  except OSError:
    return 0


def pytest_collection_finish(session):
  """The objects the imports and the collection made live as long as the process: frozen,
  no later collection walks them (`GC_THRESHOLDS`)."""
  del session
  gc.collect()
  gc.freeze()


def _release_programs() -> None:
  """Lets go of the compiled programs no live object holds. XLA:CPU maps each loaded
  executable's code and data into memory: a worker that kept every program of its files
  reached the kernel's limit of 65,530 mappings (`vm.max_map_count`), and the next load
  from the compilation cache crashed it (a segfault or abort in
  `compilation_cache.get_executable_and_time`, at 30,000 mappings after 25 minutes).
  Between test files the programs of the file before are dropped from jax's caches."""
  jax.clear_caches()
  gc.collect()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  del nextitem
  if item.path.name != _CURRENT_FILE[0]:
    _release_programs()
    _CURRENT_FILE[0] = item.path.name
    if _TIME_REPORT:
      _count("maps_at_start", _memory_maps())
  _CURRENT_TEST[0] = item.nodeid
  start = time.perf_counter()
  yield
  if _TIME_REPORT:
    _count("wall_s", time.perf_counter() - start)
    _count("tests")
    _TESTS[item.nodeid] = time.perf_counter() - start


def pytest_sessionfinish(session):
  if not _TIME_REPORT:
    return
  out = pathlib.Path(_TIME_REPORT)
  out.mkdir(parents=True, exist_ok=True)
  worker = os.environ.get("PYTEST_XDIST_WORKER")
  if worker:
    (out / f"{worker}.json").write_text(json.dumps({"files": _TIMES, "tests": _TESTS,
                                                    "test_programs": _TEST_PROGRAMS}))
    return
  merged: dict = {}
  tests: dict = {}
  test_programs: dict = {}
  for part in [*out.glob("gw*.json"), *([] if _TIMES.keys() <= {"(collection)"} else [None])]:
    saved = ({"files": _TIMES, "tests": _TESTS, "test_programs": _TEST_PROGRAMS}
             if part is None else json.loads(part.read_text()))
    tests.update(saved["tests"])
    test_programs.update(saved["test_programs"])
    for name, entry in saved["files"].items():
      for key, value in entry.items():
        merged.setdefault(name, {}).setdefault(key, 0.0)
        merged[name][key] += value
  programs: dict = {}  # By program name, over every test.
  for by_name in test_programs.values():
    for name, (count, seconds) in by_name.items():
      entry = programs.setdefault(name, [0, 0.0])
      entry[0] += count
      entry[1] += seconds
  rows = sorted(merged.items(), key=lambda kv: -kv[1].get("wall_s", 0.0))
  total = {k: sum(e.get(k, 0.0) for _, e in rows)
           for k in ("tests", "wall_s", "compile_s", "compiled", "cache_hits")}
  lines = ["| file | tests | wall s | compile s | programs (compiled or from the cache) "
           "| of them from the cache | memory maps at its start |",
           "|---|---:|---:|---:|---:|---:|---:|"]
  for name, e in [*rows, ("all (the workers' sum)", total)]:
    lines.append(f"| {name} | {e.get('tests', 0):.0f} | {e.get('wall_s', 0):.1f} | "
                 f"{e.get('compile_s', 0):.1f} | {e.get('compiled', 0):.0f} | "
                 f"{e.get('cache_hits', 0):.0f} | {e.get('maps_at_start', 0):.0f} |")
  lines += ["", "| slowest tests | wall s |", "|---|---:|"]
  lines += [f"| {name} | {seconds:.1f} |"
            for name, seconds in sorted(tests.items(), key=lambda kv: -kv[1])[:40]]
  lines += ["", "| programs, by name (in the pytest processes) | compiled or read back | seconds |",
            "|---|---:|---:|"]
  lines += [f"| {name} | {count} | {seconds:.1f} |"
            for name, (count, seconds) in sorted(programs.items(), key=lambda kv: -kv[1][1])[:30]]
  compiling = {test: (sum(c for c, _ in by_name.values()), sum(s for _, s in by_name.values()),
                      by_name.get("jit(<lambda>)", [0, 0.0])[1])
               for test, by_name in test_programs.items()}
  lines += ["", "| tests that compiled longest | programs | compile s | of it, jit(<lambda>) "
            "(states' inits, the tests' jitted lambdas) |", "|---|---:|---:|---:|"]
  lines += [f"| {test} | {count} | {seconds:.1f} | {init:.1f} |"
            for test, (count, seconds, init)
            in sorted(compiling.items(), key=lambda kv: -kv[1][1])[:40]]
  (out / "report.md").write_text("\n".join(lines) + "\n")
  (out / "report.json").write_text(json.dumps(merged, indent=1))
  (out / "test_programs.json").write_text(json.dumps(test_programs, indent=1))


def pytest_collection_modifyitems(config, items):
  del config
  counts = collections.Counter(item.path.name for item in items)

  def rank(item):
    name = item.path.name
    # Within a file, tests that read the real-MNIST run's result go last, so the file's
    # other tests run while the worker that runs it (the first MNIST command's) finishes.
    waits = name != REAL_MNIST_FILE and "real_mnist_run" in getattr(item, "fixturenames", ())
    return (name not in FIRST, -counts[name], name, waits)

  items.sort(key=rank)  # Stable: each file otherwise keeps its own order.
