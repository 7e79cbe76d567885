"""The directory a run writes to (`--workdir`), checked before anything runs.

Checkpoints (`<workdir>/checkpoints`), `metrics.jsonl`, TensorBoard event
files, a profile trace and a sweep's summary all go there, and the config the run
ran with, every override applied (`config.json`, `write_config`): what
`trainer.generate`, `trainer.harness` and `trainer.export` read from a workdir. A
path that cannot be that directory is refused before the dataset is read or a
device is touched.
"""

from __future__ import annotations

import json
import os
from typing import Any

#: The run's config in its workdir, as JSON.
CONFIG_NAME = "config.json"


def write_config(workdir: str, config: Any) -> str:
  """Writes `config` (an ml_collections `ConfigDict`) to `<workdir>/config.json`, replacing
  the file in one rename (a reader never sees half of it); returns the path.

  A value JSON cannot hold (an object a user put in the config) is written as its
  `repr`, as `ConfigDict.to_json_best_effort` does.
  """
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, CONFIG_NAME)
  try:
    text = config.to_json(indent=2)
  except (TypeError, ValueError):
    text = config.to_json_best_effort(indent=2)
  json.loads(text)  # What the commands read back.
  partial = f"{path}.tmp-{os.getpid()}"
  with open(partial, "w", encoding="utf-8") as f:
    f.write(text + "\n")
  os.replace(partial, path)
  return path


def check_workdir(path: str, *, flag: str = "--workdir") -> None:
  """Raises unless `path` is a directory, or can be made one (its nearest existing
  ancestor is a writable directory). Makes nothing.

  Raises:
    ValueError: naming the flag, the path and what is in the way.
  """
  what = ("a directory for the run's checkpoints, metrics.jsonl and TensorBoard events "
          "(made if missing)")
  if not path:
    raise ValueError(f"{flag} is empty; it must name {what}.")
  path = os.path.abspath(path)
  if os.path.exists(path) and not os.path.isdir(path):
    raise ValueError(f"{flag}={path} is a file; it must be {what}. Name another path, or "
                     f"move the file away.")
  ancestor = path
  while not os.path.exists(ancestor):
    ancestor = os.path.dirname(ancestor)
  if not os.path.isdir(ancestor):
    raise ValueError(f"{flag}={path} cannot be made: {ancestor} is a file, not a directory; "
                     f"{flag} must be {what}.")
  if not os.access(ancestor, os.W_OK | os.X_OK):
    raise ValueError(f"{flag}={path}: {ancestor} is not writable by this user; {flag} "
                     f"must be {what}.")


def flag_validator(path: str | None) -> bool:
  """`check_workdir` as an absl flag validator: `flags.register_validator('workdir',
  flag_validator)` refuses a bad `--workdir` while the flags are parsed."""
  from absl import flags
  if path is None:
    return True  # A required flag that is missing is absl's own error.
  try:
    check_workdir(path)
  except ValueError as e:
    raise flags.ValidationError(str(e)) from None
  return True
