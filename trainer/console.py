"""What a run shows on the console: one line per event, and nothing that reads like a failure
when nothing failed.

The JAX stack announces things a user cannot act on, on every start:

- jax logs at INFO that it could not start the TPU backend (`Unable to initialize
  backend 'tpu'`) on every machine without a TPU: it tries the platforms it may
  find and skips the missing ones; a platform that is asked for and fails still
  raises;
- TensorFlow, which tfds and clu's TensorBoard writer import, prints its C++
  notices (oneDNN) when it loads: `TF_CPP_MIN_LOG_LEVEL=1` keeps its warnings and
  errors, unless the user set the variable;
- tfds warns that OpenCV is not installed when it decodes an image with PIL,
  which is the decoder this project installs.

These are kept off the console at the default verbosity and shown with
`--verbosity=1` (absl's debug level), as is the full text of an event the run
reports in one line (an unreadable checkpoint's read error). `quiet()` is
called when `trainer` is imported; calling it again changes nothing.
"""

from __future__ import annotations

import logging
import os

#: Records that announce no failure: (logger name, start of the message).
NOT_FAILURES = (
    ("jax._src.xla_bridge", "Unable to initialize backend"),
    ("absl", "OpenCV is not installed"),
)
#: The length of an event's one line before it is cut (the rest at `--verbosity=1`).
LINE_CHARS = 400


def verbose() -> bool:
  """Whether the user asked for debug output (`--verbosity=1` or more)."""
  return logging.getLogger("absl").isEnabledFor(logging.DEBUG)


class _NotFailures(logging.Filter):
  """Drops the records of `NOT_FAILURES` unless `verbose()`."""

  def filter(self, record: logging.LogRecord) -> bool:
    if verbose():
      return True
    text = str(record.msg)
    return not any(record.name == name and text.startswith(start)
                   for name, start in NOT_FAILURES)


def quiet() -> None:
  """Keeps the stack's start-up notices (`NOT_FAILURES`, TensorFlow's C++ INFO) off the
  console at the default verbosity."""
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")  # Before TensorFlow loads.
  for name in {name for name, _ in NOT_FAILURES}:
    logger = logging.getLogger(name)
    if not any(isinstance(f, _NotFailures) for f in logger.filters):
      logger.addFilter(_NotFailures())


def one_line(error: BaseException | str) -> str:
  """`error` as one line of at most `LINE_CHARS` (tensorstore's specs and the rest cut),
  for an event's log line; log the whole with `logging.debug`."""
  text = " ".join(str(error).split())
  cut = text.find(" [tensorstore_spec='")
  if cut >= 0:
    end = text.find("}']", cut)
    text = text[:cut] + " [...]" + (text[end + 3:] if end >= 0 else "")
  if len(text) > LINE_CHARS:
    text = text[:LINE_CHARS - 3] + "..."
  return text
