"""Every command in the README runs as written, with few steps.

The commands that read MNIST (and TensorBoard, which reads the flagship's
logs) are in `test_readme_mnist.py`. The test command is what CI runs
(`test_repository.py` checks `.ci/run` runs it exactly).
"""

import pytest
import readme_commands as readme

RUNNABLE = readme.runnable()


def test_the_readme_commands_are_found():
  # The parser reads every bash block: the swap, LM-layout and benchmark commands among them.
  scripts = {readme.script_of(c) for c in RUNNABLE}
  assert set(readme.FEW_STEPS) <= scripts, scripts
  assert len(RUNNABLE) >= 15, RUNNABLE


def test_readme_paths_move_but_not_the_interpreter(tmp_path, monkeypatch):
  # CI's clone, and so its interpreter, may itself live under /tmp/.
  monkeypatch.setattr(readme.sys, "executable", "/tmp/ci/main/.venv/bin/python")
  runner = readme.Runner(root=tmp_path, data_dir=tmp_path / "tfds")
  argv = runner.argv(".venv/bin/python examples/x.py --workdir=/tmp/run/a --logdir /tmp/b",
                     extra=["--steps", "1"])
  assert argv == ["/tmp/ci/main/.venv/bin/python", "examples/x.py",
                  f"--workdir={tmp_path}/run/a", "--logdir", f"{tmp_path}/b", "--steps", "1"]


@pytest.mark.parametrize("command", [c for c in RUNNABLE if not readme.reads_real_mnist(c)],
                         ids=readme.command_id)
def test_readme_command_runs(command, readme_runner):
  readme.run_and_check(command, readme_runner)


def test_each_mnist_command_works_on_its_own():
  """No command relies on an earlier one having prepared MNIST: each names the files."""
  mnist = [c for c in readme.commands() if readme.script_of(c) == "examples/mnist_ensemble.py"]
  assert len(mnist) >= 5
  assert all("--config.data.manual_dir=../shared/data/mnist" in c for c in mnist), [
      c for c in mnist if "manual_dir" not in c]
