"""Tests of slipstream.config."""
