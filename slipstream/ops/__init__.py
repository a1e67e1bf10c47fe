"""Native ops: builders (`op_builder/`), C++ sources (`csrc/`), pure-PyTorch fallbacks and Python faces (`adam/`).

Importing this package compiles nothing; an op is built or loaded on first use.
"""
