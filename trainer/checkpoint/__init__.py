"""Checkpoints: the orbax store (`Checkpointer`) and the run state it saves (`RunState`)."""

from trainer.checkpoint.run_state import RunState, restore_run, save_run
from trainer.checkpoint.store import Checkpointer, CheckpointError, check_compatible

__all__ = ["CheckpointError", "Checkpointer", "RunState", "check_compatible", "restore_run",
           "save_run"]
