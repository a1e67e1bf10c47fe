"""Small shared utilities (logging)."""
