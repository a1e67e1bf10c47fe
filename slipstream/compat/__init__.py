"""DeepSpeed-only surface: the engine getters real callers use (Transformers, Accelerate)."""
