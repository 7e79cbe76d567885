"""Command-line choices the benchmarks share; it imports no jax, so a bad choice is refused
before any device is made."""

import argparse
from collections.abc import Sequence


def rows(parser: argparse.ArgumentParser, flag: str, value: str, names: Sequence[str], *,
         baseline: str) -> list[str]:
  """`baseline`, then the comma-separated names of `value` in the order given (the baseline
  always runs first, whether named or not).

  An unknown name is refused (`parser.error`), naming the flag and the names accepted.
  """
  chosen = list(dict.fromkeys(v.strip() for v in value.split(",") if v.strip()))
  if unknown := sorted(set(chosen) - set(names)):
    parser.error(f"{flag}={value!r}: {unknown} are not among {list(names)}")
  return [baseline] + [v for v in chosen if v != baseline]
