"""The README's commands that read MNIST, run as written with few steps.

The README's first command (install, then train the flagship ensemble on the
real MNIST files) runs once per session with 200 steps (`real_mnist_run`,
which `test_mnist_example.py` also checks); it prepares MNIST into the data
directory the later commands read, as it would for a user. TensorBoard serves
that run's logs.
"""

import pytest
import readme_commands as readme


@pytest.mark.parametrize("command", [c for c in readme.runnable() if readme.reads_real_mnist(c)],
                         ids=readme.command_id)
def test_readme_mnist_command_runs(command, readme_runner, real_mnist_run):
  if command == real_mnist_run.command:  # The first command: run once, with 200 steps.
    readme.check(command, real_mnist_run.result)
  else:
    readme.run_and_check(command, readme_runner)
