// Exact int8 GEMMs of the CPU expert FFN on weights prepacked once per matrix, and the switch that
// picks the kernel variants (runtime CPU dispatch: the library is built for the baseline ISA, so one
// cached binary serves every CPU of its architecture).
//
// Integer products are exact however they are computed, so every GEMM variant returns the same
// int32 accumulators as ATen's `_int_mm`; the float epilogues around them are untouched.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>

namespace cam_jit_cpu {

// The GEMM of the expert matmuls. kIntMm: ATen `_int_mm` on the weights as stored (portable).
// kVnni: AVX512-VNNI (vpdpbusd) on prepacked weights, prefetching ahead in the weight panels it
// streams (a lone row block: int4 panels into L2, int8 panels by the hardware prefetcher alone; the
// first of several row blocks: into L1). kAmx: AMX int8 tiles on prepacked weights. kVnniL1: kVnni
// prefetching into L1 in every row block.
enum class GemmKernel { kIntMm = 0, kVnni = 1, kAmx = 2, kVnniL1 = 3 };
inline bool is_vnni(GemmKernel k) { return k == GemmKernel::kVnni || k == GemmKernel::kVnniL1; }
// The element-wise stages (quantisation, dequantisation, SwiGLU). kScalar: portable loops.
// kAvx512: AVX512 intrinsics, bit-identical to the scalar loops.
enum class VectorKernel { kScalar = 0, kAvx512 = 1 };

// The GEMM variant for a product of `rows` activation rows (auto: AMX from 16 rows, VNNI below;
// VNNI prefetching into L1 on Intel CPUs, into L2 elsewhere).
GemmKernel gemm_kernel(int64_t rows);
VectorKernel vector_kernel();
// Whether the expert FFN writes its bf16 output of `bytes` bytes with streaming (non-temporal) stores,
// past the caches: always under the forced variant "avx512_stream", never under a forced "avx512" or
// "scalar", and under auto on AVX512 CPUs when it is larger than the threads' L2 caches together.
bool stream_expert_output(int64_t bytes);

// A weight matrix W [K, N] (int8, or int4 values packed 8 per int32 word as [K, N/8]) rearranged for
// the VNNI/AMX kernels: 16-column blocks, each a contiguous panel of K/4 rows of 16 columns x 4
// consecutive k (int8: [N/16][Kp/4][16][4] bytes, exactly an AMX B tile every 64 k). int4: two such
// 64-byte rows per 64 bytes, k-group 2p in the low nibbles and 2p+1 in the high nibbles, each
// nibble holding w + 8 (0..15). K is padded to Kp (multiple of 64) and N to Np (multiple of 16)
// with zero weights.
struct PackedMatrix {
  at::Tensor panel;  // uint8, Np * Kp bytes (int8) or Np * Kp / 2 (int4)
  at::Tensor comp;   // int32 [Np]: 128 * column sums of W (int8 only; the VNNI u8 offset)
  int64_t k = 0, n = 0, kp = 0, np = 0;
  bool int4 = false;
};

// The packed form of `w` (int8 [K, N], or int32 [K, N/8] words when `int4`), from the prepack
// cache: keyed by storage, offset, shape, strides and the tensor's version counter, so an in-place
// update repacks; entries die with their storage. Inference tensors (no version counter) are
// packed afresh on every call.
std::shared_ptr<const PackedMatrix> packed_matrix(const at::Tensor& w, bool int4);
// packed_matrix(stacked[e], int4) for a stacked weight [E, K, N] (int4: [E, K, N/8]), the same cache
// entry, without making the view.
std::shared_ptr<const PackedMatrix> packed_matrix(const at::Tensor& stacked, int64_t e, bool int4);

// How a packed kernel takes its activation rows: kU8 the VNNI operand q + 128 (as q ^ 0x80) against
// int8 weights, kS8 q itself (AMX), kNibbles the W4A8 nibble split hi = q >> 4, lo = (q & 15) - 8.
enum class RowForm { kU8, kS8, kNibbles };

// Activation rows for the packed kernels, padded with zeros to kp columns (and, for AMX, to a
// multiple of 16 rows): `a` [padded rows, kp] the rows in their form, for kNibbles a = hi, b = lo
// and sum8 int32 [2, padded rows] = 8 * their row sums. In memory of the caller's, or of `owner`.
struct PackedRows {
  at::Tensor owner;
  int8_t* a = nullptr;
  int8_t* b = nullptr;
  int32_t* sum8 = nullptr;
  int64_t m = 0, k = 0;             // rows and columns of q
  int64_t padded_rows = 0, kp = 0;  // of a and b
  RowForm form = RowForm::kU8;
};

// Bytes (a multiple of 64) of the rows packed_rows lays out for m rows against w for `kernel`.
int64_t packed_rows_bytes(const PackedMatrix& w, int64_t m, GemmKernel kernel);
// Room for m activation rows of K == w.k columns for `kernel` (kVnni or kAmx) against w in `memory`
// (packed_rows_bytes of it, 64-byte aligned, kept alive by the caller), the padding zeroed; set_row
// fills row r < m from q[0..K) int8 (rows may be set from several threads at once).
PackedRows packed_rows(const PackedMatrix& w, int64_t m, GemmKernel kernel, void* memory);
// As above, in memory the rows own.
PackedRows packed_rows(const PackedMatrix& w, int64_t m, GemmKernel kernel);
void set_row(const PackedRows& rows, int64_t r, const int8_t* q);

// The VNNI product q . W split into column groups of kVnniGroupColumns columns, the unit of work a
// caller schedules (several products in one parallel region, epilogues fused per group).
constexpr int64_t kVnniGroupColumns = 64;
int64_t vnni_groups(const PackedMatrix& w);
// A column group the calling thread multiplies after the current one (none: w == nullptr). The VNNI
// kernels start fetching its weights while they finish the current group.
struct VnniNext {
  const PackedMatrix* w = nullptr;
  int64_t g = 0;
};
// Exact q . W on the columns [64 g, min(64 g + 64, N)) of group g, q the rows (packed_rows for kVnni):
// acc[r * ld + c] for r < M and c the column within the group. int4 weights: hi . W into acc, lo . W
// into lo_acc. `kernel` (a VNNI one) says how it prefetches ahead in the group's panels and on into
// `next`. Needs VNNI.
void vnni_group(const PackedRows& rows, const PackedMatrix& w, int64_t g, int32_t* acc, int32_t* lo_acc,
                int64_t ld, GemmKernel kernel, VnniNext next = {});

// The AMX product on the same column groups as the VNNI one (vnni_groups(w) of them), q the rows
// (packed_rows for kAmx, padded to a multiple of 16): exact q . W on the 16-column blocks of group g
// into acc, which holds the padded row count of `ld` ints each (ld >= 64): the group's blocks fill
// columns [0, 16 * blocks) with the columns past N and the rows past M zero. int4 weights: hi . W
// into acc, lo . W into lo_acc.
void amx_group(const PackedRows& rows, const PackedMatrix& w, int64_t g, int32_t* acc, int32_t* lo_acc, int64_t ld);

// acc = q . W exactly, with q [M, K] int8 contiguous. W8A8: int32 [M, N]. int4 weights (W4A8):
// int32 [2M, N], rows 0..M-1 = hi . W and rows M..2M-1 = lo . W with hi = q >> 4 and
// lo = (q & 15) - 8 (the W4A8 nibble split). `kernel` is kVnni or kAmx.
at::Tensor packed_matmul(const at::Tensor& q, const PackedMatrix& w, GemmKernel kernel);

}  // namespace cam_jit_cpu
