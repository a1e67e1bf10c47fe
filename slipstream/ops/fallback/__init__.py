"""Pure-PyTorch fallbacks of the native ops: same functions and signatures as the compiled modules."""
