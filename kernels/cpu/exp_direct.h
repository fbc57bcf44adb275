// exp over float32 arrays without ATen's dispatcher, element for element what at::exp gives.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace cam_jit_cpu {

// Whether exp_direct may run on this build: ATen's CPU exp of float32 is MKL's vmsExp (x86-64
// builds with MKL; the library exports it), and at first use a probe of values across the float
// range, the special values and short lengths gives bit for bit what at::exp gives. False on
// builds without it (aarch64, a torch built without MKL): callers then use at::exp_.
bool exp_direct_available();

// v[i] = exp(v[i]) for i < n (n < 2^31) on the calling thread, through vmsExp; only after
// exp_direct_available() returned true.
void exp_direct(float* v, int64_t n);

// The op _cam_jit_cpu::exp_direct (for tests): exp of a float32 tensor through exp_direct; raises
// where exp_direct_available() is false.
at::Tensor exp_direct_op(const at::Tensor& x);

}  // namespace cam_jit_cpu
