"""Reads a corpus at a user's lengths in `--workers` Grain workers, then ends: what
`tests/test_long_rows.py` runs in a process of its own.

    python tests/long_rows_run.py --root=DIR --workers=2 --lengths=512,1024

`DIR` holds `corpus_files`' word tokenizer and `long.jsonl` (documents of hundreds of
words). For each length it reads `--batches` batches of 8 rows, checks that every
trained target is the next token of the same document, waits so that the workers fill
their queues with blocks larger than a pipe holds, and prints the worker processes'
ids. The first length's iterator is closed; the last one's is left to the
interpreter's exit, as a script that never calls `close` leaves it. With `--hold`, it
waits after printing, for a signal.
"""

import argparse
import os
import pathlib
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import corpus_files as cf  # noqa: E402
import numpy as np  # noqa: E402

from trainer.data import corpus, lm, packing  # noqa: E402


def children() -> list[int]:
  """This process's child processes (Linux)."""
  pids = []
  for task in pathlib.Path(f"/proc/{os.getpid()}/task").iterdir():
    pids += [int(p) for p in (task / "children").read_text().split()]
  return pids


def check_rows(batch) -> int:
  """Raises unless every trained target is the next token of its row's document; returns
  the trained targets."""
  inputs, targets = batch["inputs"], batch["targets"]
  segments = batch[packing.SEGMENT_IDS]
  trained = 0
  for row in range(len(inputs)):
    for i in np.flatnonzero(segments[row] > 0):
      doc, target = cf.doc_of(int(inputs[row, i])), int(targets[row, i])
      if i + 1 < inputs.shape[1] and segments[row, i + 1] == segments[row, i]:
        assert inputs[row, i + 1] == target, (row, i)
      if cf.doc_of(target) is not None and doc is not None:
        assert cf.doc_of(target) == doc, (row, i, doc, target)
      trained += 1
  return trained


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--root", required=True)
  parser.add_argument("--workers", type=int, required=True)
  parser.add_argument("--lengths", default="512,1024")
  parser.add_argument("--batches", type=int, default=3)
  parser.add_argument("--hold", action="store_true")
  args = parser.parse_args()
  root = pathlib.Path(args.root)
  source = corpus.resolve(str(root / "long.jsonl"), field="text", weight=1.0, where="sources")
  tokenizer = corpus.Tokenizer(str(root))
  lengths = [int(n) for n in args.lengths.split(",")]
  iterators = []
  for length in lengths:
    stream = lm.Corpus([source], tokenizer, length=length, batch_size=8, lanes=4,
                       workers=args.workers)()
    trained = 0
    for _ in range(args.batches):
      batch = next(stream)
      assert batch["inputs"].shape == (8, length), batch["inputs"].shape
      trained += check_rows(batch)
    time.sleep(1.0)  # The workers fill their queues meanwhile.
    print(f"length {length}: {trained} targets checked; workers {children()}", flush=True)
    iterators.append(stream)
    if length != lengths[-1]:
      stream.close()
  print("READ", flush=True)
  if args.hold:
    time.sleep(600)


if __name__ == "__main__":  # Grain's workers start by spawning: the guard is needed.
  main()
