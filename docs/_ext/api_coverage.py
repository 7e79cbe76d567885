"""A check of the docs build: the API reference misses no public module and no public name.

Every module of `trainer`, `strategies` and `models` whose dotted name has no
part starting with `_` must have a page (an `automodule`), and every name in
a documented module's `__all__` must be documented there or where it is
defined. A miss is a warning, which the build (`-W`) turns into an error.
"""

from __future__ import annotations

import importlib
import pkgutil

from sphinx.util import logging

logger = logging.getLogger(__name__)

#: The packages whose public API the reference covers.
PACKAGES = ("trainer", "strategies", "models")


def public_modules() -> list[str]:
  """Every public module of `PACKAGES`, packages included."""
  names = []
  for package in PACKAGES:
    names.append(package)
    path = importlib.import_module(package).__path__
    names += [m.name for m in pkgutil.walk_packages(path, package + ".")
              if not any(part.startswith("_") for part in m.name.split("."))]
  return sorted(names)


def _check(app, env) -> None:
  del app
  domain = env.get_domain("py")
  documented, objects = set(domain.modules), set(domain.objects)
  for name in public_modules():
    if name not in documented:
      logger.warning("API reference: public module %s has no page (docs/api/index.md lists "
                     "the packages; autosummary makes a page for each module)", name,
                     type="api_coverage")
      continue
    module = importlib.import_module(name)
    for member in getattr(module, "__all__", ()):
      value = getattr(module, member)
      if hasattr(value, "__module__") and hasattr(value, "__qualname__"):
        found = {f"{name}.{member}", f"{value.__module__}.{value.__qualname__}"} & objects
      else:  # A constant: documented where it is defined, somewhere in this package.
        found = {o for o in objects if o.startswith(name + ".") and o.endswith("." + member)}
      if not found:
        logger.warning("API reference: %s.%s (in its __all__) is not documented; give it a "
                       "docstring (or a `#:` comment, for a constant)", name, member,
                       type="api_coverage")


def setup(app):
  app.connect("env-check-consistency", _check)
  return {"parallel_read_safe": True, "parallel_write_safe": True}
