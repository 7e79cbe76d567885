"""The documented commands that read MNIST, run as written with few steps.

The README's first command (install, then train the flagship ensemble on the
real MNIST files) runs once per session with 200 steps (`real_mnist_run`,
which `test_mnist_example.py` also checks); it prepares MNIST into the data
directory the later commands read, as it would for a user. TensorBoard serves
that run's logs.
"""

import doc_commands as docs
import pytest


@pytest.mark.parametrize("command", [c for c in docs.runnable() if docs.reads_real_mnist(c)],
                         ids=docs.command_id)
def test_documented_mnist_command_runs(command, doc_runner, real_mnist_run):
  if command == real_mnist_run.command:  # The first command: run once, with 200 steps.
    docs.check(command, real_mnist_run.result)
  else:
    docs.run_and_check(command, doc_runner)
