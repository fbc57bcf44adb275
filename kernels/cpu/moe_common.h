// Shared helpers of the CPU MoE kernels (namespace _cam_jit_cpu).
//
// Numerical contract: docs/semantics.md §1.8. Every float operation below is a single IEEE float32
// operation; the build passes -ffp-contract=off so the compiler never fuses a multiply and an add.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <memory>

namespace cam_jit_cpu {

// Where the [K_in, N] matrix (item_dim == 2) or [N] vector (item_dim == 1) of local expert `e` lies in
// a weight container: one stacked tensor with a leading expert dimension (`of`, index e), one
// un-stacked tensor (single local expert: `of` itself, e = -1), or one tensor per expert (the e-th,
// e = -1) (docs/semantics.md §1.3).
struct ExpertSlot {
  const at::Tensor& of;
  int64_t e;
};

inline ExpertSlot expert_slot(at::TensorList container, int64_t e, int64_t item_dim) {
  const int64_t count = static_cast<int64_t>(container.size());
  if (count == 1) {
    const at::Tensor& only = container[0];
    const bool stacked = only.dim() == item_dim + 1;
    TORCH_CHECK(stacked ? e >= 0 && e < only.size(0) : e == 0, "_cam_jit_cpu: local expert ", e,
                " is not in the weight container of shape ", only.sizes());
    return {only, stacked ? e : -1};
  }
  TORCH_CHECK(e >= 0 && e < count, "_cam_jit_cpu: local expert ", e, " is not in a weight container of ", count,
              " tensors");
  return {container[e], -1};
}

// The item of local expert `e` (see expert_slot), a view for a stacked container.
inline at::Tensor expert_item(at::TensorList container, int64_t e, int64_t item_dim) {
  const ExpertSlot slot = expert_slot(container, e, item_dim);
  return slot.e < 0 ? slot.of : slot.of.select(0, slot.e);
}

// Round-half-to-even to an int8 quantisation level. Python has validated finite inputs for the
// normal path; a NaN (from non-finite activations) becomes 0 instead of undefined behaviour, and
// the NaN still reaches the output through the row scale.
inline int8_t round_to_int8(float v) {
  float r = std::nearbyint(v);
  if (std::isnan(r)) return 0;
  r = r > 127.f ? 127.f : (r < -127.f ? -127.f : r);
  return static_cast<int8_t>(r);
}

// max(|v|) that propagates NaN, so non-finite activations end as NaN outputs instead of being
// silently dropped from the row maximum.
inline float abs_max(float running, float v) {
  const float a = std::fabs(v);
  return (a > running || std::isnan(a)) && !std::isnan(running) ? a : running;
}

inline void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "_cam_jit_cpu: ", name, " must be a CPU tensor, got ", t.device());
}

// v rounded up to a multiple of m (v >= 0, m > 0).
inline int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

// Scratch memory kept by its (thread_local) owner across calls and grown on demand: fresh memory of
// some size costs a page fault per 4 KiB on every call, and malloc / free pairs per call add up at
// decode sizes. Not zeroed. Buffers grown past kKeptBytes (a large prefill batch) are given back
// by trim() after the call.
class KeptBuffer {
 public:
  static constexpr size_t kKeptBytes = size_t{8} << 20;
  // Room for `count` values of T, 64-byte aligned, valid until the next get() or trim().
  template <typename T>
  T* get(size_t count) {
    const size_t bytes = static_cast<size_t>(round_up(static_cast<int64_t>(count * sizeof(T)), 64));
    if (bytes > bytes_) {
      memory_.reset(static_cast<char*>(std::aligned_alloc(64, bytes)));
      TORCH_CHECK(memory_ != nullptr, "cam_jit: out of memory for ", bytes, " bytes of scratch");
      bytes_ = bytes;
    }
    return reinterpret_cast<T*>(memory_.get());
  }
  void trim() {
    if (bytes_ > kKeptBytes) {
      memory_.reset();
      bytes_ = 0;
    }
  }

 private:
  struct Free {
    void operator()(char* p) const { std::free(p); }
  };
  std::unique_ptr<char, Free> memory_;
  size_t bytes_ = 0;
};

}  // namespace cam_jit_cpu
