"""What a run shows on the console: one line per event, and nothing that reads like a failure
when nothing failed.

The JAX stack announces things a user cannot act on, on every start:

- jax logs at INFO that it could not start the TPU backend (`Unable to initialize
  backend 'tpu'`) on every machine without a TPU: it tries the platforms it may
  find and skips the missing ones; a platform that is asked for and fails still
  raises;
- TensorFlow, which tfds imports to prepare a dataset, prints its C++ notices
  (oneDNN, the CPU instructions it was not built for) when it loads:
  `TF_CPP_MIN_LOG_LEVEL=1` keeps its warnings and errors, unless the user set the
  variable; TensorFlow 2.21 writes these notices through absl's C++ logging before
  that is initialised, past the variable, so the first import of `tensorflow`
  runs with its standard error captured and written back without them;
- tfds warns that OpenCV is not installed when it decodes an image with PIL,
  which is the decoder this project installs;
- orbax logs dozens of INFO lines for each checkpoint it saves or reads (its
  handlers, throughput, the files); its warnings and errors stay.

These are kept off the console at the default verbosity and shown with
`--verbosity=1` (absl's debug level), as is the full text of an event the run
reports in one line (an unreadable checkpoint's read error). `quiet()` is
called when `trainer` is imported; calling it again changes nothing.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import os
import sys
import tempfile

#: Records that announce no failure: (logger name, start of the message).
NOT_FAILURES = (
    ("jax._src.xla_bridge", "Unable to initialize backend"),
    ("absl", "OpenCV is not installed"),
)
#: What TensorFlow's C++ start-up writes to standard error that announces no failure.
TF_NOTICES = ("oneDNN custom operations are on", "This TensorFlow binary is optimized",
              "To enable the following instructions", "rebuild TensorFlow with the appropriate",
              "WARNING: All log messages before absl::InitializeLog()")
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


class _DropOrbaxInfo(logging.Filter):
  """Drops INFO records logged from orbax's own files unless `verbose()`."""

  def filter(self, record: logging.LogRecord) -> bool:
    return (record.levelno > logging.INFO or f"{os.sep}orbax{os.sep}" not in record.pathname
            or verbose())


def quiet_orbax_info() -> None:
  """Keeps orbax's INFO lines off the console (orbax logs through absl, as the project does,
  so the filter tells them apart by the file a record comes from); its warnings and errors
  stay. On the loggers and on the handlers already installed."""
  for name in ("absl", ""):
    logger = logging.getLogger(name)
    for target in (logger, *logger.handlers):
      if not any(isinstance(f, _DropOrbaxInfo) for f in target.filters):
        target.addFilter(_DropOrbaxInfo())


def quiet() -> None:
  """Keeps the stack's start-up notices (`NOT_FAILURES`, TensorFlow's C++ notices) and
  orbax's INFO lines off the console at the default verbosity."""
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")  # Before TensorFlow loads.
  # absl's logger must be absl's own class before anything asks for the logger by name: a
  # plain `logging.Logger` named "absl" (what `getLogger` makes first) gives every record
  # the file and line of absl's `log` function, and a `-m trainer.<command>` imports this
  # package before the command's own `from absl import ...`.
  import absl.logging  # noqa: F401
  for name in {name for name, _ in NOT_FAILURES}:
    logger = logging.getLogger(name)
    if not any(isinstance(f, _NotFailures) for f in logger.filters):
      logger.addFilter(_NotFailures())
  quiet_orbax_info()
  if "tensorflow" not in sys.modules and not any(
      isinstance(f, _QuietTensorFlowImport) for f in sys.meta_path):
    sys.meta_path.insert(0, _QuietTensorFlowImport())


class _QuietTensorFlowImport(importlib.abc.MetaPathFinder):
  """Finds `tensorflow` with the other finders, once, and loads it with standard error (the
  file descriptor: C++ writes there) captured; what it wrote comes back less `TF_NOTICES`
  (all of it at `--verbosity=1`)."""

  _finding = False

  def find_spec(self, name, path, target=None):
    # A look-up that is not an import (`importlib.util.find_spec`, as tfds checks what is
    # installed) gets the same wrapped spec; the finder leaves once the module is loaded.
    if name != "tensorflow" or self._finding:
      return None
    self._finding = True
    try:
      spec = importlib.util.find_spec(name)  # The other finders' (this one skips itself).
    finally:
      self._finding = False
    if spec is not None and spec.loader is not None:
      spec.loader = _QuietLoader(spec.loader, self)
    return spec


class _QuietLoader(importlib.abc.Loader):
  def __init__(self, loader, finder):
    self._loader, self._finder = loader, finder

  def create_module(self, spec):
    return self._loader.create_module(spec)

  def exec_module(self, module):
    if self._finder in sys.meta_path:
      sys.meta_path.remove(self._finder)
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
      os.dup2(captured.fileno(), 2)
      try:
        self._loader.exec_module(module)
      finally:
        os.dup2(saved, 2)
        os.close(saved)
        captured.seek(0)
        text = captured.read().decode(errors="replace")
        kept = [line for line in text.splitlines(keepends=True) if verbose() or (
            line.strip() and not any(n in line for n in TF_NOTICES))]
        if kept:
          sys.stderr.write("".join(kept))
          sys.stderr.flush()


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
