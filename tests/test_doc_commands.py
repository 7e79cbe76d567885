"""Every command in the README and the docs runs as written, with few steps.

The commands that read MNIST (and TensorBoard, which reads the flagship's
logs) are in `test_doc_commands_mnist.py`. The test command is what CI runs
(`test_repository.py` checks `.ci/run` runs it exactly); the docs command is
`test_docs.py`'s.
"""

import doc_commands as docs
import pytest

RUNNABLE = docs.runnable()


def test_the_doc_commands_are_found():
  # The parser reads every bash block: the swap, LM-layout and benchmark commands among them.
  scripts = {docs.script_of(c) for c in RUNNABLE}
  assert set(docs.FEW_STEPS) <= scripts, scripts
  assert len(RUNNABLE) >= 15, RUNNABLE


def test_documented_paths_move_but_not_the_interpreter(tmp_path, monkeypatch):
  # CI's clone, and so its interpreter, may itself live under /tmp/.
  monkeypatch.setattr(docs.sys, "executable", "/tmp/ci/main/.venv/bin/python")
  runner = docs.Runner(root=tmp_path)
  argv = runner.argv(".venv/bin/python examples/x.py --workdir=/tmp/run/a --logdir /tmp/b",
                     extra=["--steps", "1"])
  assert argv == ["/tmp/ci/main/.venv/bin/python", "examples/x.py",
                  f"--workdir={tmp_path}/run/a", "--logdir", f"{tmp_path}/b", "--steps", "1"]


@pytest.mark.parametrize("command", [c for c in RUNNABLE if not docs.reads_real_mnist(c)
                                     and not docs.on_the_user_path(c)], ids=docs.command_id)
def test_documented_command_runs(command, doc_runner):
  docs.run_and_check(command, doc_runner)


def test_each_mnist_command_works_on_its_own():
  """No command relies on an earlier one having prepared MNIST: each names the files."""
  mnist = [c for c in docs.commands() if docs.script_of(c) == "examples/mnist_ensemble.py"]
  assert len(mnist) >= 5
  assert all("--config.data.manual_dir=../shared/data/mnist" in c for c in mnist), [
      c for c in mnist if "manual_dir" not in c]


def test_the_docs_command_names_the_mnist_files_as_the_first_command_does():
  # Its notebook prepares MNIST: on a machine with no network and an empty TFDS data
  # directory, only the files the command names make that possible.
  (command,) = [c for c in docs.commands() if docs.is_docs_command(c)]
  build = next(s for s in docs.steps(command) if "sphinx-build" in s)
  env, rest = docs.assignments(build)
  assert env == {"TFDS_MANUAL_DIR": "../shared/data/mnist"}
  assert rest.startswith(".venv/bin/sphinx-build ")


def test_a_documented_command_gets_a_fresh_shells_environment(tmp_path, monkeypatch):
  # Nothing the tests (or this machine) set reaches it: no TFDS directories, no XLA flags.
  for name in ("TFDS_MANUAL_DIR", "TFDS_DATA_DIR", "XLA_FLAGS", "TF_CPP_MIN_LOG_LEVEL"):
    monkeypatch.setenv(name, "/from/the/tests")
  runner = docs.Runner(root=tmp_path)
  env = runner.env("A=1 B='two words' .venv/bin/python examples/x.py")
  assert env["HOME"] == str(tmp_path / "home") and not runner.data_dir.exists()
  assert env["A"] == "1" and env["B"] == "two words"
  assert set(env) <= {"HOME", "A", "B", *docs.SHELL_VARIABLES, *docs.CACHE_VARIABLES}
  assert runner.argv("x && A=1 .venv/bin/python examples/x.py", extra=[]) == [
      docs.sys.executable, "examples/x.py"]


def test_the_docs_pages_commands_are_among_them():
  """The getting-started page's commands are found and run, the README's once each."""
  page = docs.page_commands(docs.ROOT / "docs" / "getting_started.md")
  assert len(page) >= 6 and set(page) <= set(docs.commands())
  assert len(docs.commands()) == len(set(docs.commands()))
  assert sum(docs.is_docs_command(c) for c in docs.commands()) == 1


def test_the_readmes_example_is_the_program_the_docs_run():
  """Each line of the README's Python example is a line of `examples/my_trainer.py`."""
  import re
  block = re.search(r"```python\n(.*?)```", docs.README.read_text(), flags=re.S).group(1)
  program = {line.split("  # noqa")[0].strip()
             for line in (docs.ROOT / "examples" / "my_trainer.py").read_text().splitlines()}
  lines = [line.strip() for line in block.splitlines() if line.strip()]
  assert len(lines) >= 12
  assert [line for line in lines if line not in program] == []
