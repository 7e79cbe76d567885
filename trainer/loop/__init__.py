"""The training loop (`driver`) and its side effects (`actions`)."""
