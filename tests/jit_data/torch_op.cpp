// Test library that registers an op the way the real backends do (TORCH_LIBRARY, no Python).
#include <torch/library.h>

namespace {
int64_t answer(int64_t x) { return x + 42; }
}  // namespace

TORCH_LIBRARY(_cam_jit_test, m) {
  m.def("answer(int x) -> int", &answer);
}
