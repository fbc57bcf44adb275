// exp_direct: MKL's vmsExp, called as ATen's vml::vexp calls it (ATen/cpu/vml.h), checked against
// at::exp once per process before first use.
#include "exp_direct.h"

#include <ATen/ops/exp.h>
#include <ATen/ops/from_blob.h>

#include <dlfcn.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace cam_jit_cpu {
namespace {

// vmsExp(MKL_INT n, const float* a, float* r, MKL_INT64 mode). MKL_INT is int (LP64, what torch
// links) or int64 (ILP64); an int64 n below 2^31 passes in the same register either way.
using VmsExp = void (*)(int64_t n, const float* a, float* r, int64_t mode);
// VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE: the mode vml.h passes.
constexpr int64_t kVmlMode = 0x2 | 0x140000 | 0x100;

bool same_bits(float a, float b) {
  return std::memcmp(&a, &b, sizeof a) == 0 || (std::isnan(a) && std::isnan(b));
}

// The probe: every 2^19 + 1-th bit pattern (all signs, exponents, NaNs and subnormals), the
// range where exp is neither 0, 1 nor inf in fine steps, and the edges of that range.
std::vector<float> probe_values() {
  std::vector<float> v;
  for (uint64_t bits = 0; bits <= 0xFFFFFFFFull; bits += (1u << 19) + 1) {
    const uint32_t b = static_cast<uint32_t>(bits);
    float f;
    std::memcpy(&f, &b, sizeof f);
    v.push_back(f);
  }
  for (int i = -104 * 64; i <= 89 * 64; ++i) {
    v.push_back(static_cast<float>(i) / 64.f + 1e-3f * static_cast<float>(i % 7));
  }
  using limits = std::numeric_limits<float>;
  for (float f : {0.f, -0.f, limits::infinity(), -limits::infinity(), limits::quiet_NaN(), limits::denorm_min(),
                  -limits::denorm_min(), limits::min(), 88.72283f, 88.72284f, 88.7229f, -87.33654f, -87.33655f,
                  -103.97208f, -103.9721f, -104.f, 1e-8f, -1e-8f}) {
    v.push_back(f);
  }
  return v;
}

VmsExp checked_vms_exp() {
  const auto f = reinterpret_cast<VmsExp>(dlsym(RTLD_DEFAULT, "vmsExp"));
  if (f == nullptr) return nullptr;
  std::vector<float> in = probe_values();
  const int64_t n = static_cast<int64_t>(in.size());
  const at::Tensor want = at::exp(at::from_blob(in.data(), {n}, at::TensorOptions().dtype(at::kFloat)));
  const float* w = want.data_ptr<float>();
  std::vector<float> got(in);  // in place, as exp_direct runs
  f(n, got.data(), got.data(), kVmlMode);
  for (int64_t i = 0; i < n; ++i) {
    if (!same_bits(got[i], w[i])) return nullptr;
  }
  // Short arrays at unaligned starts: the vector tails.
  for (int64_t len = 1; len <= 40; ++len) {
    for (int64_t start = 0; start < 3; ++start) {
      std::memcpy(got.data(), in.data() + 8192 + start, len * sizeof(float));
      f(len, got.data(), got.data(), kVmlMode);
      for (int64_t i = 0; i < len; ++i) {
        if (!same_bits(got[i], w[8192 + start + i])) return nullptr;
      }
    }
  }
  return f;
}

VmsExp vms_exp() {
  static const VmsExp f = checked_vms_exp();
  return f;
}

}  // namespace

bool exp_direct_available() { return vms_exp() != nullptr; }

void exp_direct(float* v, int64_t n) {
  if (n > 0) vms_exp()(n, v, v, kVmlMode);
}

at::Tensor exp_direct_op(const at::Tensor& x) {
  TORCH_CHECK(exp_direct_available(), "_cam_jit_cpu::exp_direct: not available on this build");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.numel() < (int64_t{1} << 31),
              "_cam_jit_cpu::exp_direct: x must be a CPU float32 tensor of fewer than 2^31 elements, got ",
              x.scalar_type(), " on ", x.device());
  at::Tensor out = x.contiguous().clone();
  exp_direct(out.data_ptr<float>(), out.numel());
  return out;
}

}  // namespace cam_jit_cpu
