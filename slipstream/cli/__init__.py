"""The `slipstream` command line: `slipstream report` now; `run`, `plan` and `export` join it later."""
