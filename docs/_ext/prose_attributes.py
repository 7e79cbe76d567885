"""This project's `#:` comments on constants and attributes are prose, not Google style's
`type: description`, which napoleon would otherwise read into the first line's colon
(`#: The exit status of ...: try again` would become a type named "The exit status of ...").

Each such docstring reaches napoleon with an empty type in front (`: ...`), so the whole
first line stays its description; the type autodoc shows is the annotation's.
"""

from __future__ import annotations


def _prose(app, what, name, obj, options, lines) -> None:
  del app, name, obj, options
  if what in ("attribute", "data", "property") and lines and ":" in lines[0]:
    lines[0] = ": " + lines[0]


def setup(app):
  # Before napoleon (priority 500), which reads the first line's colon.
  app.connect("autodoc-process-docstring", _prose, priority=100)
  return {"parallel_read_safe": True, "parallel_write_safe": True}
