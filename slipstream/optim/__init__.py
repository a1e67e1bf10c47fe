"""Optimizers that are ours (LAMB, Muon, ...); config/optimizers.py is the registry that declares them."""
