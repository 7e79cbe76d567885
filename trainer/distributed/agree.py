"""Decisions every process of a run takes the same way.

A barrier or collective must be entered by all processes of a run or by none.
Where entering one depends on what a process sees for itself (a directory on a
shared filesystem another process may just have made, a file only it failed to
read, a lock only process 0 takes), the processes first agree on it here: each
says what it sees, and all act on the one answer. Every process must call these
functions at the same point; on one process they are the identity and cost
nothing.
"""

from __future__ import annotations

import jax
import numpy as np


def per_process(flag: bool) -> np.ndarray:
  """Every process's `flag`, indexed by process (a collective on several processes)."""
  if jax.process_count() == 1:
    return np.asarray([bool(flag)])
  from jax.experimental import multihost_utils
  return np.asarray(multihost_utils.process_allgather(np.asarray(bool(flag))), bool).reshape(-1)


def any_process(flag: bool) -> bool:
  """Whether `flag` holds on any process (the same answer on all of them)."""
  return bool(per_process(flag).any())


def every_process_json(value) -> list:
  """Every process's JSON-serialisable `value`, indexed by process (two collectives on
  several processes: the lengths, then the padded bytes)."""
  import json
  data = np.frombuffer(json.dumps(value).encode(), np.uint8)
  if jax.process_count() == 1:
    return [value]
  from jax.experimental import multihost_utils
  lengths = np.asarray(multihost_utils.process_allgather(np.asarray(len(data)))).reshape(-1)
  padded = np.zeros(int(lengths.max()), np.uint8)
  padded[:len(data)] = data
  every = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(lengths), -1)
  return [json.loads(bytes(row[:n]).decode()) for row, n in zip(every, lengths, strict=True)]
