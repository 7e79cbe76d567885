"""Every command in the README runs as written, with few steps.

The README's first command (install, then train the flagship ensemble on the
real MNIST files) runs once per session with 200 steps (`real_mnist_run`,
which `test_mnist_example.py` also checks); it prepares MNIST into the data
directory the later commands read, as it would for a user. The test command
is what CI runs (`test_repository.py` checks `.ci/run` runs it exactly).
"""

import json
import re
import time
import urllib.request

import pytest
import readme_commands as readme

RUNNABLE = [c for c in readme.commands() if not readme.is_test_command(c)]


def _id(command: str) -> str:
  return readme.last_step(command).removeprefix(".venv/bin/")[:90]


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


@pytest.mark.parametrize("command", RUNNABLE, ids=_id)
def test_readme_command_runs(command, readme_runner, real_mnist_run):
  if command == real_mnist_run.command:  # The first command: run once, with 200 steps.
    result = real_mnist_run.result
  elif readme.script_of(command):
    script = readme.script_of(command)
    assert script in readme.FEW_STEPS, f"no few-step flags for {script} in readme_commands.py"
    result = readme_runner.run(command)
  elif readme.last_step(command).startswith(".venv/bin/tensorboard"):
    _serves_the_logged_scalars(command, readme_runner)
    return
  else:
    pytest.fail(f"README command {command!r} has no runner in tests/readme_commands.py")
  output = result.stdout + result.stderr
  assert result.returncode == 0, output[-5000:]
  assert re.search(readme.EXPECTED_OUTPUT[readme.script_of(command)], result.stdout,
                   flags=re.M), output[-3000:]


def _serves_the_logged_scalars(command, runner):
  """Starts the README's TensorBoard on a free loopback port and reads the run's tags."""
  logdir = runner.path(re.search(r"--logdir\s+/tmp/(\S+)", command).group(1))
  assert list(logdir.glob("events.out.tfevents.*")), f"no event file in {logdir}"
  server = runner.popen(command, extra=["--port", "0"])
  try:
    url, deadline = None, time.monotonic() + 120
    while url is None and time.monotonic() < deadline:
      line = server.stdout.readline()
      assert line or server.poll() is None, "tensorboard exited before serving"
      match = re.search(r"TensorBoard \S+ at (http://localhost:\d+/)", line)
      url = match and match.group(1)
    assert url, "tensorboard did not report its address within 120 s"
    tags = {}
    for _ in range(60):  # The run's event file is loaded in the background.
      with urllib.request.urlopen(url + "data/plugin/scalars/tags", timeout=10) as response:
        tags = json.load(response)
      if any("train/loss" in run_tags for run_tags in tags.values()):
        break
      time.sleep(1)
    assert any({"train/loss", "eval/ensemble_accuracy"} <= set(run_tags)
               for run_tags in tags.values()), tags
  finally:
    server.terminate()
    server.wait(timeout=30)
