"""Names a package exports from its modules, imported on first use (PEP 562), so that
importing the package loads nothing heavy: `python -m trainer.distributed.launch` starts
processes without jax, and an entry point reads `trainer.sweep.members` while it parses
its flags."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping


def exports(package: str, names: Mapping[str, str], gone: Mapping[str, str] | None = None
            ) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
  """`(__getattr__, __dir__)` for `package`: each of `names` (name -> the module defining
  it) imported when first read; each of `gone` (name -> what replaced it) an
  `AttributeError` that says so."""
  gone = dict(gone or {})

  def __getattr__(name: str):
    if name in gone:
      raise AttributeError(f"{package}.{name} is gone: {gone[name]}.")
    if name not in names:
      raise AttributeError(f"module {package!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(names[name]), name)
    vars(sys.modules[package])[name] = value
    return value

  def __dir__():
    return sorted(set(vars(sys.modules[package])) | set(names))

  return __getattr__, __dir__
