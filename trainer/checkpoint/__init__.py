"""Checkpoints: the orbax store (`Checkpointer`) and the run state it saves (`RunState`)."""

from trainer.checkpoint.run_state import RunState, restore_run, save_run
from trainer.checkpoint.store import (
  Checkpointer,
  CheckpointError,
  CorruptCheckpointError,
  check_compatible,
)

__all__ = ["CheckpointError", "Checkpointer", "CorruptCheckpointError", "RunState",
           "check_compatible", "restore_run", "save_run"]
