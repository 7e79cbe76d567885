"""The README's commands are the ones CI runs."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
  text = (ROOT / "README.md").read_text()
  return re.findall(r"```bash\n(.+?)\n```", text)


def test_ci_runs_the_readme_test_command_exactly():
  commands = _readme_commands()
  test_commands = [c for c in commands if "pytest" in c]
  assert len(test_commands) == 1, commands
  ci_script = (ROOT / ".ci" / "run").read_text().splitlines()
  assert test_commands[0] in ci_script
