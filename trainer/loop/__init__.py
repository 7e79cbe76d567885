"""The training loop (`driver`), the action interface (`actions`) and the built-in actions
(`builtin`)."""
