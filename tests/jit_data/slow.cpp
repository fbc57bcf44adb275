// Test library that takes ~2 s to compile (constexpr evaluation), so a build can be observed,
// waited for and killed while the compiler runs.
constexpr unsigned long long spin(unsigned outer) {
  unsigned long long x = 1;
  for (unsigned i = 0; i < outer; ++i)
    for (unsigned j = 0; j < 1000; ++j) x = x * 6364136223846793005ULL + j;
  return x;
}
extern "C" unsigned long long cam_jit_slow() {
  constexpr unsigned long long value = spin(1400);
  return value;
}
