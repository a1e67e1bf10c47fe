"""`engine.compile()`: regional compilation of the model's repeated blocks (regions.py), the graph breaks each
compiled region had (graph_breaks.py), compiled autograd where torch has it (autograd.py), and the engine's
methods that tie them together (engine_compile.py). See docs/compile.md."""
