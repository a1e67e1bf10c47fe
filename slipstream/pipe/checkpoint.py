"""Pipeline checkpoints (filled in below)."""
