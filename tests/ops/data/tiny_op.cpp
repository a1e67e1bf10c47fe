// A tiny native op used only by the JIT cache tests: compiles in seconds (pybind11 only, no ATen).
#include <pybind11/pybind11.h>

#ifndef TINY_OP_VALUE
#define TINY_OP_VALUE 1
#endif

int tiny_value() { return TINY_OP_VALUE; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("tiny_value", &tiny_value, "the compiled-in value"); }
