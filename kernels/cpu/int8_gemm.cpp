// Exact int8 GEMMs on prepacked weights (AVX512-VNNI and AMX), the prepack cache and the kernel
// variant switch. See int8_gemm.h for the packed layout.
//
// VNNI (vpdpbusd) multiplies unsigned by signed bytes. W8A8 feeds q + 128 (u8) against the s8
// weights and subtracts 128 * colsum(W); W4A8 feeds the nibble weights w + 8 (u8) against the s8
// hi / lo activations and subtracts 8 * rowsum(hi or lo). AMX (tdpbssd) multiplies signed by signed
// bytes directly. Every sum is an exact int32 (wrap-around arithmetic, results within int32).
#include "int8_gemm.h"

#include "exp_direct.h"

#include "moe_common.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/zeros.h>
#include <c10/core/StorageImpl.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define CAM_JIT_X86 1
#define CAM_JIT_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))
// For the helpers that issue software prefetches in a kernel's loop. GCC 12 splits such a helper
// (the test inline, the prefetch in an outlined part), then finds the outlined part free of side
// effects and deletes its calls: the kernels issued none of those prefetches.
#define CAM_JIT_PREFETCH_HELPER __attribute__((always_inline))
// For the row-block kernels: one function per block shape and prefetch kind whatever the compiler's
// inlining, so that the test of their prefetches finds each in the library's disassembly.
#define CAM_JIT_BLOCK_KERNEL __attribute__((noinline))
#define CAM_JIT_AMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,amx-tile,amx-int8")))
#endif

namespace cam_jit_cpu {
namespace {

constexpr int64_t kBlockN = 16;  // columns per packed block (one zmm of int32, one AMX tile row)
constexpr int64_t kBlockK = 64;  // K padding: one AMX tile of k
constexpr int kVnniNr = kVnniGroupColumns / kBlockN;  // 16-column blocks per VNNI register tile
constexpr int kVnniMrI8 = 6;  // 24 accumulators
constexpr int kVnniMrI4 = 2;  // 16 accumulators + 8 unpacked weight vectors


// ---------------------------------------------------------------------------------------------
// What this CPU and OS can run.

struct CpuFeatures {
  bool avx512 = false;  // AVX512 F/BW/VL/DQ with the OS saving zmm state
  bool vnni = false;    // plus AVX512-VNNI
  bool amx = false;     // AMX-TILE and AMX-INT8 with the OS granting tile data to this process
  bool intel = false;   // CPUID vendor GenuineIntel
};

#if defined(CAM_JIT_X86)
uint64_t xcr0() {
  uint32_t eax, edx;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<uint64_t>(edx) << 32) | eax;
}

// Linux keeps AMX tile data off until a process asks (arch_prctl ARCH_REQ_XCOMP_PERM).
bool request_amx_permission() {
  constexpr int kArchReqXcompPerm = 0x1023;
  constexpr int kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

CpuFeatures detect_features() {
  CpuFeatures f;
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid(0, &eax, &ebx, &ecx, &edx)) return f;
  f.intel = ebx == 0x756e6547 && edx == 0x49656e69 && ecx == 0x6c65746e;  // "Genu" "ineI" "ntel"
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx) || !(ecx & (1u << 27))) return f;  // OSXSAVE
  const uint64_t xcr = xcr0();
  const bool zmm_state = (xcr & 0xe6) == 0xe6;  // SSE, AVX, opmask, ZMM_Hi256, Hi16_ZMM
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return f;
  const bool avx512f = ebx & (1u << 16), avx512dq = ebx & (1u << 17), avx512bw = ebx & (1u << 30),
             avx512vl = ebx & (1u << 31);
  f.avx512 = zmm_state && avx512f && avx512dq && avx512bw && avx512vl;
  f.vnni = f.avx512 && (ecx & (1u << 11));
  const bool amx_hw = (edx & (1u << 24)) && (edx & (1u << 25));  // AMX-TILE, AMX-INT8
  const bool tile_state = (xcr & (3u << 17)) == (3u << 17);       // XTILECFG, XTILEDATA
  f.amx = f.vnni && amx_hw && tile_state && request_amx_permission();
  return f;
}
#else
CpuFeatures detect_features() { return {}; }
#endif

const CpuFeatures& features() {
  static const CpuFeatures f = detect_features();
  return f;
}

// ---------------------------------------------------------------------------------------------
// The variant switch: "auto" (the best this CPU runs; AMX from kAmxMinRows rows, VNNI below) or a
// forced variant. Set from CAM_JIT_CPU_GEMM / CAM_JIT_CPU_VECTOR at load, or select_kernels().
// Auto's VNNI prefetches into L1 on Intel CPUs and into L2 elsewhere: measured at one row (weights
// streaming from memory), prefetching into L1 saved a quarter of the product's time on a Xeon
// (Sapphire Rapids) and cost a sixth on an AMD EPYC, where prefetching into L2 saves a tenth.

constexpr int64_t kAmxMinRows = 16;
constexpr int kAuto = -1;

const char* const kGemmNames[] = {"int_mm", "vnni", "amx", "vnni_l1"};
constexpr int kGemmCount = 4;
// avx512_stream: avx512 with the expert FFN's bf16 output written past the caches (auto picks it when
// that output outgrows the L2 caches, see stream_expert_output).
const char* const kVectorNames[] = {"scalar", "avx512", "avx512_stream"};
constexpr int kVectorCount = 3;
constexpr int kVectorStream = 2;

bool gemm_available(int v) {
  return v == 0 || ((v == 1 || v == 3) && features().vnni) || (v == 2 && features().amx);
}
bool vector_available(int v) { return v == 0 || (v >= 1 && features().avx512); }

int parse_variant(const std::string& name, const char* const* names, int count, bool (*available)(int),
                  const char* what) {
  if (name == "auto") return kAuto;
  for (int v = 0; v < count; ++v) {
    if (name == names[v]) {
      TORCH_CHECK(available(v), "cam_jit: the ", what, " kernel '", name, "' cannot run on this CPU");
      return v;
    }
  }
  std::string known = "auto";
  for (int v = 0; v < count; ++v) known += std::string(", ") + names[v];
  TORCH_CHECK(false, "cam_jit: unknown ", what, " kernel '", name, "'; expected one of: ", known);
}

int variant_from_env(const char* env, const char* const* names, int count, bool (*available)(int),
                     const char* what) {
  const char* value = std::getenv(env);
  if (value == nullptr || *value == '\0') return kAuto;
  return parse_variant(value, names, count, available, what);
}

std::atomic<int>& gemm_setting() {
  static std::atomic<int> s{variant_from_env("CAM_JIT_CPU_GEMM", kGemmNames, kGemmCount, gemm_available, "GEMM")};
  return s;
}
std::atomic<int>& vector_setting() {
  static std::atomic<int> s{
      variant_from_env("CAM_JIT_CPU_VECTOR", kVectorNames, kVectorCount, vector_available, "vector")};
  return s;
}

std::string setting_name(int v, const char* const* names) { return v == kAuto ? "auto" : names[v]; }

// ---------------------------------------------------------------------------------------------
// Packing.

// Memory for `bytes` bytes of packed panels. From 2 MiB on it is mapped afresh on a 2 MiB boundary and
// marked for transparent huge pages before its first touch (Linux; "madvise" is the usual THP mode, and
// memory already touched stays in 4 KiB pages). The kernels stream the panels: with them in huge
// pages the op took 0.94-1.00x the time at one row per expert on an AMD EPYC (level from 8 rows on).
at::Tensor panel_memory(int64_t bytes, const at::TensorOptions& options) {
#if defined(__linux__)
  constexpr int64_t kHuge = int64_t{2} << 20;
  if (bytes >= kHuge) {
    const int64_t size = round_up(bytes, 4096);
    void* mapped = mmap(nullptr, size + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    TORCH_CHECK(mapped != MAP_FAILED, "cam_jit prepack: cannot map ", size, " bytes for packed weights");
    char* const base = static_cast<char*>(mapped);
    char* const start = base + (kHuge - reinterpret_cast<uintptr_t>(base) % kHuge) % kHuge;
    if (start > base) munmap(base, start - base);
    munmap(start + size, base + kHuge - start);
    madvise(start, size, MADV_HUGEPAGE);  // advice: where THP is off the memory stays in small pages
    return at::from_blob(start, {bytes}, [size](void* p) { munmap(p, size); }, options);
  }
#endif
  return at::empty({bytes}, options);
}

// Element (k, n) of an int8 matrix, or of an int4 one stored as [K, N/8] int32 words (column
// 8w + s is nibble s of word w, two's complement).
struct WeightReader {
  const int8_t* i8 = nullptr;
  const int32_t* i32 = nullptr;
  int64_t ld = 0;
  int operator()(int64_t k, int64_t n) const {
    if (i8 != nullptr) return i8[k * ld + n];
    const uint32_t word = static_cast<uint32_t>(i32[k * ld + n / 8]);
    const int nib = static_cast<int>((word >> (4 * (n % 8))) & 15u);
    return nib >= 8 ? nib - 16 : nib;
  }
};

std::shared_ptr<PackedMatrix> pack(const at::Tensor& w, bool int4) {
  TORCH_CHECK(w.dim() == 2, "cam_jit prepack: weight must be 2-D, got ", w.sizes());
  TORCH_CHECK(w.scalar_type() == (int4 ? at::kInt : at::kChar), "cam_jit prepack: weight must be ",
              int4 ? "int32 (packed int4)" : "int8", ", got ", w.scalar_type());
  const at::Tensor wc = w.contiguous();
  auto p = std::make_shared<PackedMatrix>();
  p->int4 = int4;
  p->k = wc.size(0);
  p->n = wc.size(1) * (int4 ? 8 : 1);
  p->kp = round_up(std::max<int64_t>(p->k, 1), kBlockK);
  p->np = round_up(std::max<int64_t>(p->n, 1), kBlockN);
  WeightReader read;
  read.ld = wc.size(1);
  if (int4) {
    read.i32 = wc.data_ptr<int32_t>();
  } else {
    read.i8 = wc.data_ptr<int8_t>();
  }
  const int64_t k = p->k, n = p->n, kp = p->kp, blocks = p->np / kBlockN;
  auto value = [&](int64_t kk, int64_t nn) { return kk < k && nn < n ? read(kk, nn) : 0; };
  if (int4) {
    p->panel = panel_memory(p->np * kp / 2, wc.options().dtype(at::kByte));
    uint8_t* dst = p->panel.data_ptr<uint8_t>();
    at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        uint8_t* panel = dst + b * (kp / 8) * 64;
        for (int64_t pair = 0; pair < kp / 8; ++pair) {
          for (int64_t c = 0; c < kBlockN; ++c) {
            for (int64_t kk = 0; kk < 4; ++kk) {
              const int lo = value(8 * pair + kk, b * kBlockN + c) + 8;
              const int hi = value(8 * pair + 4 + kk, b * kBlockN + c) + 8;
              panel[pair * 64 + c * 4 + kk] = static_cast<uint8_t>(lo | (hi << 4));
            }
          }
        }
      }
    });
    return p;
  }
  p->panel = panel_memory(p->np * kp, wc.options().dtype(at::kByte));
  p->comp = at::empty({p->np}, wc.options().dtype(at::kInt));
  uint8_t* dst = p->panel.data_ptr<uint8_t>();
  int32_t* comp = p->comp.data_ptr<int32_t>();
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      uint8_t* panel = dst + b * kp * kBlockN;
      int32_t colsum[kBlockN] = {};
      for (int64_t k4 = 0; k4 < kp / 4; ++k4) {
        for (int64_t c = 0; c < kBlockN; ++c) {
          for (int64_t kk = 0; kk < 4; ++kk) {
            const int v = value(4 * k4 + kk, b * kBlockN + c);
            colsum[c] += v;
            panel[k4 * 64 + c * 4 + kk] = static_cast<uint8_t>(static_cast<int8_t>(v));
          }
        }
      }
      for (int64_t c = 0; c < kBlockN; ++c) comp[b * kBlockN + c] = 128 * colsum[c];
    }
  });
  return p;
}

// ---------------------------------------------------------------------------------------------
// The prepack cache.

struct CacheKey {
  const void* storage;
  int64_t offset, size0, size1, stride0, stride1;
  bool int4;
  bool operator<(const CacheKey& o) const {
    return std::tie(storage, offset, size0, size1, stride0, stride1, int4) <
           std::tie(o.storage, o.offset, o.size0, o.size1, o.stride0, o.stride1, o.int4);
  }
};

struct CacheEntry {
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;  // the StorageImpl (not its bytes) stays allocated
  uint32_t version;
  std::shared_ptr<const PackedMatrix> packed;
};

struct PrepackCache {
  std::mutex mutex;
  std::map<CacheKey, CacheEntry> entries;

  void drop_expired() {
    for (auto it = entries.begin(); it != entries.end();) {
      it = it->second.storage.expired() ? entries.erase(it) : std::next(it);
    }
  }
  int64_t bytes() {
    int64_t total = 0;
    for (const auto& [key, entry] : entries) {
      total += entry.packed->panel.nbytes() + (entry.packed->comp.defined() ? entry.packed->comp.nbytes() : 0);
    }
    return total;
  }
};

PrepackCache& cache() {
  static PrepackCache* c = new PrepackCache();  // never destroyed: tensors may outlive static teardown
  return *c;
}

// The cache entry `key` of a matrix of `base` (the matrix itself or the stacked tensor it is a slice
// of: both share the storage, the version counter and inference-ness), packing matrix() on a miss.
template <typename Matrix>
std::shared_ptr<const PackedMatrix> cached_pack(const at::Tensor& base, const CacheKey& key, const Matrix& matrix) {
  if (base.is_inference()) return pack(matrix(), key.int4);
  const uint32_t version = base.unsafeGetTensorImpl()->version_counter().current_version();
  PrepackCache& c = cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  auto it = c.entries.find(key);
  if (it != c.entries.end() && !it->second.storage.expired() && it->second.version == version) {
    return it->second.packed;
  }
  c.drop_expired();
  std::shared_ptr<const PackedMatrix> packed = pack(matrix(), key.int4);
  c.entries.insert_or_assign(key, CacheEntry{base.storage().getWeakStorageImpl(), version, packed});
  return packed;
}

}  // namespace

std::shared_ptr<const PackedMatrix> packed_matrix(const at::Tensor& w, bool int4) {
  check_cpu(w, "weight");
  TORCH_CHECK(w.dim() == 2, "cam_jit prepack: weight must be 2-D, got ", w.sizes());
  const CacheKey key{w.storage().unsafeGetStorageImpl(), w.storage_offset(), w.size(0), w.size(1),
                     w.stride(0), w.stride(1), int4};
  return cached_pack(w, key, [&] { return w; });
}

std::shared_ptr<const PackedMatrix> packed_matrix(const at::Tensor& stacked, int64_t e, bool int4) {
  check_cpu(stacked, "weight");
  TORCH_CHECK(stacked.dim() == 3 && e >= 0 && e < stacked.size(0), "cam_jit prepack: expert ", e,
              " is not in the stacked weight of shape ", stacked.sizes());
  const CacheKey key{stacked.storage().unsafeGetStorageImpl(), stacked.storage_offset() + e * stacked.stride(0),
                     stacked.size(1), stacked.size(2), stacked.stride(1), stacked.stride(2), int4};
  return cached_pack(stacked, key, [&] { return stacked.select(0, e); });
}

GemmKernel gemm_kernel(int64_t rows) {
  const int s = gemm_setting().load();
  if (s != kAuto) return static_cast<GemmKernel>(s);
  if (features().amx && rows >= kAmxMinRows) return GemmKernel::kAmx;
  if (!features().vnni) return GemmKernel::kIntMm;
  return features().intel ? GemmKernel::kVnniL1 : GemmKernel::kVnni;
}

VectorKernel vector_kernel() {
  const int s = vector_setting().load();
  if (s == kVectorStream) return VectorKernel::kAvx512;
  if (s != kAuto) return static_cast<VectorKernel>(s);
  return features().avx512 ? VectorKernel::kAvx512 : VectorKernel::kScalar;
}

// Measured on an AMD EPYC (1 MiB L2 per core, 2 threads), the W8A8 op against cached stores: 0.975x
// the time at BS 256 (4 MiB of output; median of 10 rounds) and 0.98x at 512; level at 128 (2 MiB);
// 1.01x at 64, where combine then read the rows back from memory instead of the caches.
bool stream_expert_output(int64_t bytes) {
#if defined(CAM_JIT_X86)
  const int s = vector_setting().load();
  if (s == kVectorStream) return true;
  if (s != kAuto || !features().avx512) return false;
  static const int64_t l2_bytes = [] {
    const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
    return l2 > 0 ? static_cast<int64_t>(l2) : int64_t{1} << 20;
  }();
  return bytes > at::get_num_threads() * l2_bytes;
#else
  (void)bytes;
  return false;
#endif
}

namespace {

// ---------------------------------------------------------------------------------------------
// AVX512-VNNI kernels. A row block of MR rows times NR 16-column blocks lives in registers; the
// K loop streams NR packed panels once per row block.

#if defined(CAM_JIT_X86)
// acc += u8 . s8 in each int32 lane (vpdpbusd), accumulating in place. With the intrinsic GCC 12
// copies every accumulator of a block into a spare register and back on each k step (and spills
// from four rows on), which makes the kernels issue-bound at a few rows.
CAM_JIT_AVX512 inline __m512i dpbusd(__m512i acc, __m512i u8, __m512i s8) {
  __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u8), "vm"(s8));
  return acc;
}

// How far ahead of the current k step the VNNI kernels prefetch in each panel they stream, and into
// which cache (kNone: no software prefetch; see vnni_group for which row block does which). At
// M <= 6 they are bound by memory latency. On a Xeon the hardware prefetcher alone kept too few
// lines in flight over 4 concurrent panels; on an AMD EPYC, with the panels in huge pages, it
// streams int8 panels of a lone row block faster alone (the W8A8 op at one row per expert:
// 0.84-0.93x the time without the prefetch, level at 4 rows), while int4 panels need it (the W4A8
// op 1.28-1.34x the time without), 4 KiB ahead into L2 (6-13 % faster than 1 KiB; 8 KiB: level).
// The first of several row blocks prefetching into L1 rather than L2 made the op 2-4 % faster at
// BS 64 and 256 on the EPYC (W4A8: 4-13 % at BS 8, 2-5 % at 64, level at 256).
enum class Ahead { kNone, kL1, kL2 };
template <Ahead kAhead>
constexpr int64_t kPrefetchBytes = kAhead == Ahead::kL1 ? 2048 : 4096;  // kL2: int4 panels only

// Bytes of one packed 16-column panel of w (int4: two weights a byte).
int64_t vnni_panel_bytes(const PackedMatrix& w) { return w.kp * kBlockN / (w.int4 ? 2 : 1); }

// The panels a VNNI kernel streams (`panel`, `panel_bytes` apart) and those the thread multiplies
// after them (`next`, `next_bytes` apart). The prefetch runs kPrefetchBytes ahead in each panel and,
// past the panel's end, on into the next panels: at decode sizes a panel is 8-32 KiB, and fetching
// the first 2 KiB of every panel on demand costs a quarter of the time.
// Both kernels also bring a stretch of the thread's next column group into L2 (`to_l2`, a line per
// k step for `l2_steps` steps) in every row block but the last: with many rows a group's products
// are compute-bound, and without it the first row block of each group waits on memory for the
// panels: 2.5x the cycles of the other row blocks on an AMD EPYC, where the op took 1.18x the time
// without it at 32 rows per expert and 1.045x at 128. Spreading the lines over all row blocks
// instead was level.
struct PanelPrefetch {
  const uint8_t* panel;
  int64_t panel_bytes;
  const uint8_t* next;
  int64_t next_bytes;
  const uint8_t* l2 = nullptr;
  int64_t l2_steps = 0;
  // Prefetches the line kPrefetchBytes past byte `at` of each of the first nr panels.
  template <Ahead kAhead>
  CAM_JIT_AVX512 CAM_JIT_PREFETCH_HELPER void ahead(int64_t at, int nr) const {
    if constexpr (kAhead == Ahead::kNone) return;
    constexpr int64_t distance = kPrefetchBytes<kAhead>;
    const int64_t wrap = panel_bytes - distance;
    const uint8_t* line = at < wrap ? panel + at + distance : next + (at - wrap);
    const int64_t stride = at < wrap ? panel_bytes : next_bytes;
    for (int j = 0; j < nr; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(line + j * stride), kAhead == Ahead::kL1 ? _MM_HINT_T0 : _MM_HINT_T1);
    }
  }
  CAM_JIT_AVX512 CAM_JIT_PREFETCH_HELPER void to_l2(int64_t step) const {
    if (step < l2_steps) _mm_prefetch(reinterpret_cast<const char*>(l2 + step * 64), _MM_HINT_T1);
  }
};

template <int MR, int NR, Ahead kAhead>
CAM_JIT_AVX512 CAM_JIT_BLOCK_KERNEL void vnni_i8_block(const uint8_t* a, int64_t lda, PanelPrefetch panels, int64_t k4s,
                                  const int32_t* comp, int32_t* out, int64_t ldo, int64_t ncols) {
  const uint8_t* panel = panels.panel;
  const int64_t panel_bytes = panels.panel_bytes;
  __m512i acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_si512();
  for (int64_t k4 = 0; k4 < k4s; ++k4) {
    panels.ahead<kAhead>(k4 * 64, NR);
    panels.to_l2(k4);
    __m512i w[NR];
    for (int j = 0; j < NR; ++j) {
      w[j] = _mm512_load_si512(panel + j * panel_bytes + k4 * 64);
    }
    for (int i = 0; i < MR; ++i) {
      int32_t bytes4;
      std::memcpy(&bytes4, a + i * lda + 4 * k4, 4);
      const __m512i x = _mm512_set1_epi32(bytes4);
      for (int j = 0; j < NR; ++j) acc[i][j] = dpbusd(acc[i][j], x, w[j]);
    }
  }
  for (int j = 0; j < NR; ++j) {
    const int64_t valid = std::min<int64_t>(kBlockN, ncols - j * kBlockN);
    const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1u);
    const __m512i c = _mm512_loadu_si512(comp + j * kBlockN);
    for (int i = 0; i < MR; ++i) {
      _mm512_mask_storeu_epi32(out + i * ldo + j * kBlockN, mask, _mm512_sub_epi32(acc[i][j], c));
    }
  }
}

// int4 weights: each 64-byte panel row holds k-groups 2p (low nibbles) and 2p + 1 (high nibbles) of
// 16 columns. A single row (MR == 1, the decode case) keeps two accumulators per output, one per
// k-group, so that the two vpdpbusd of a k step do not wait on each other; more rows have no
// registers for that.
template <int MR, int NR, Ahead kAhead>
CAM_JIT_AVX512 CAM_JIT_BLOCK_KERNEL void vnni_i4_block(const int8_t* hi, const int8_t* lo, int64_t lda, PanelPrefetch panels, int64_t k8s,
                                  const int32_t* hi_sum8, const int32_t* lo_sum8, int32_t* out_hi, int32_t* out_lo,
                                  int64_t ldo, int64_t ncols) {
  const uint8_t* panel = panels.panel;
  const int64_t panel_bytes = panels.panel_bytes;
  constexpr int S = MR == 1 ? 2 : 1;  // accumulators per output
  __m512i acc_hi[S][MR][NR], acc_lo[S][MR][NR];
  for (int s = 0; s < S; ++s)
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) acc_hi[s][i][j] = acc_lo[s][i][j] = _mm512_setzero_si512();
  const __m512i low4 = _mm512_set1_epi8(15);
  for (int64_t k8 = 0; k8 < k8s; ++k8) {
    panels.ahead<kAhead>(k8 * 64, NR);
    panels.to_l2(k8);
    __m512i w0[NR], w1[NR];
    for (int j = 0; j < NR; ++j) {
      const __m512i v = _mm512_load_si512(panel + j * panel_bytes + k8 * 64);
      w0[j] = _mm512_and_si512(v, low4);
      w1[j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
    }
    for (int i = 0; i < MR; ++i) {
      int32_t h[2], l[2];
      std::memcpy(h, hi + i * lda + 8 * k8, 8);
      std::memcpy(l, lo + i * lda + 8 * k8, 8);
      const __m512i h0 = _mm512_set1_epi32(h[0]), h1 = _mm512_set1_epi32(h[1]);
      const __m512i l0 = _mm512_set1_epi32(l[0]), l1 = _mm512_set1_epi32(l[1]);
      for (int j = 0; j < NR; ++j) {
        acc_hi[0][i][j] = dpbusd(acc_hi[0][i][j], w0[j], h0);
        acc_hi[S - 1][i][j] = dpbusd(acc_hi[S - 1][i][j], w1[j], h1);
        acc_lo[0][i][j] = dpbusd(acc_lo[0][i][j], w0[j], l0);
        acc_lo[S - 1][i][j] = dpbusd(acc_lo[S - 1][i][j], w1[j], l1);
      }
    }
  }
  for (int j = 0; j < NR; ++j) {
    const int64_t valid = std::min<int64_t>(kBlockN, ncols - j * kBlockN);
    const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1u);
    for (int i = 0; i < MR; ++i) {
      __m512i h = acc_hi[0][i][j], l = acc_lo[0][i][j];
      if constexpr (S == 2) {
        h = _mm512_add_epi32(h, acc_hi[1][i][j]);
        l = _mm512_add_epi32(l, acc_lo[1][i][j]);
      }
      _mm512_mask_storeu_epi32(out_hi + i * ldo + j * kBlockN, mask,
                               _mm512_sub_epi32(h, _mm512_set1_epi32(hi_sum8[i])));
      _mm512_mask_storeu_epi32(out_lo + i * ldo + j * kBlockN, mask,
                               _mm512_sub_epi32(l, _mm512_set1_epi32(lo_sum8[i])));
    }
  }
}

// Calls block<mr, nr>(args...) for runtime mr in [1, MR], nr in [1, NR].
template <int MR, int NR, template <int, int> class Block, typename... Args>
void dispatch_block(int mr, int nr, Args... args) {
  if constexpr (MR > 1) {
    if (mr < MR) return dispatch_block<MR - 1, NR, Block>(mr, nr, args...);
  }
  if constexpr (NR > 1) {
    if (nr < NR) return dispatch_block<MR, NR - 1, Block>(mr, nr, args...);
  }
  Block<MR, NR>::run(args...);
}

template <int MR, int NR>
struct VnniI8 {
  template <typename... Args>
  static void run(Ahead ahead, Args... args) {  // int8 panels are prefetched into L1 or not at all
    if (ahead == Ahead::kL1) return vnni_i8_block<MR, NR, Ahead::kL1>(args...);
    vnni_i8_block<MR, NR, Ahead::kNone>(args...);
  }
};
template <int MR, int NR>
struct VnniI4 {
  template <typename... Args>
  static void run(Ahead ahead, Args... args) {
    if (ahead == Ahead::kL1) return vnni_i4_block<MR, NR, Ahead::kL1>(args...);
    if (ahead == Ahead::kL2) return vnni_i4_block<MR, NR, Ahead::kL2>(args...);
    vnni_i4_block<MR, NR, Ahead::kNone>(args...);
  }
};

// ---------------------------------------------------------------------------------------------
// AMX kernels: C tiles 0-3 (16 x 16 int32), A tiles 4-5 (16 rows x 64 k), B tiles 6-7 (64 k x 16
// columns, straight from the packed panel). Rows are padded to multiples of 16 in the activation
// and output buffers. The weights stream from memory once per call while a pair of panels is
// reused from L2 by every row block, so while one pair runs the kernels prefetch the next pair's
// bytes (the panels that follow in memory, up to `prefetch_end`) into L2, a few lines per k step.

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

CAM_JIT_AMX void amx_configure() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  // An asm memory operand: GCC 12's _tile_loadconfig builtin does not tell the optimiser that it
  // reads cfg, which then drops the stores above.
  __asm__ volatile("ldtilecfg %0" : : "m"(cfg));
}

// Prefetches [from, end) into L2 in `steps` about equal slices, one slice per call of next().
struct PairPrefetch {
  const char* line;
  const char* end;
  int64_t per_step;
  PairPrefetch(const uint8_t* from, const uint8_t* limit, int64_t bytes, int64_t steps)
      : line(reinterpret_cast<const char*>(from)),
        end(reinterpret_cast<const char*>(std::min(from + std::max<int64_t>(bytes, 0), std::max(from, limit)))),
        per_step((bytes / 64 + steps - 1) / steps) {}
  CAM_JIT_PREFETCH_HELPER void next() {
    for (int64_t i = 0; i < per_step && line < end; ++i, line += 64) _mm_prefetch(line, _MM_HINT_T1);
  }
};

// C[mp, 16 (b1 - b0)] (ldc ints) = A [mp, kp] s8 times the int8 B panels of 16-column blocks
// [b0, b1) (each kp x 16 s8, 64-byte rows), two blocks per tile pass.
CAM_JIT_AMX void amx_i8_blocks(const int8_t* a, int64_t mp, const uint8_t* panels, int64_t kp, int64_t b0,
                               int64_t b1, const uint8_t* prefetch_end, int32_t* c, int64_t ldc) {
  const int64_t panel_bytes = kp * kBlockN;
  const int64_t ldc_bytes = ldc * 4;
  for (int64_t b = b0; b < b1; b += 2) {
    const bool two_n = b + 1 < b1;
    const uint8_t* p0 = panels + b * panel_bytes;
    const uint8_t* p1 = p0 + panel_bytes;
    PairPrefetch prefetch(p0 + 2 * panel_bytes, prefetch_end, 2 * panel_bytes, (mp + 31) / 32 * (kp / kBlockK));
    for (int64_t r = 0; r < mp; r += 32) {
      const bool two_m = r + 16 < mp;
      const int8_t* a0 = a + r * kp;
      const int8_t* a1 = a0 + 16 * kp;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t k = 0; k < kp; k += kBlockK) {
        prefetch.next();
        _tile_loadd(4, a0 + k, kp);
        _tile_loadd(6, p0 + k * kBlockN, 64);
        _tile_dpbssd(0, 4, 6);
        if (two_n) {
          _tile_loadd(7, p1 + k * kBlockN, 64);
          _tile_dpbssd(1, 4, 7);
        }
        if (two_m) {
          _tile_loadd(5, a1 + k, kp);
          _tile_dpbssd(2, 5, 6);
          if (two_n) _tile_dpbssd(3, 5, 7);
        }
      }
      int32_t* c0 = c + r * ldc + (b - b0) * kBlockN;
      _tile_stored(0, c0, ldc_bytes);
      if (two_n) _tile_stored(1, c0 + kBlockN, ldc_bytes);
      if (two_m) {
        _tile_stored(2, c0 + 16 * ldc, ldc_bytes);
        if (two_n) _tile_stored(3, c0 + 16 * ldc + kBlockN, ldc_bytes);
      }
    }
  }
}

// W4A8: per pair of 16-column blocks, the int4 panels are unpacked once into `scratch` (2 x kp x
// 16 s8), then every 16-row block of hi and lo runs against them: C tiles 0 / 1 = hi x block 0 / 1,
// 2 / 3 = lo x block 0 / 1.
CAM_JIT_AMX void amx_i4_blocks(const int8_t* hi, const int8_t* lo, int64_t mp, const uint8_t* panels, int64_t kp,
                               int64_t b0, int64_t b1, const uint8_t* prefetch_end, int32_t* c_hi, int32_t* c_lo,
                               int64_t ldc, uint8_t* scratch) {
  const int64_t panel_bytes = kp * kBlockN / 2;
  const int64_t ldc_bytes = ldc * 4;
  const __m512i low4 = _mm512_set1_epi8(15), eight = _mm512_set1_epi8(8);
  uint8_t* const unpacked[2] = {scratch, scratch + kp * kBlockN};
  for (int64_t b = b0; b < b1; b += 2) {
    const bool two_n = b + 1 < b1;
    for (int64_t half = 0; half < (two_n ? 2 : 1); ++half) {
      const uint8_t* src = panels + (b + half) * panel_bytes;
      for (int64_t pair = 0; pair < kp / 8; ++pair) {
        const __m512i v = _mm512_load_si512(src + pair * 64);
        _mm512_store_si512(unpacked[half] + pair * 128, _mm512_sub_epi8(_mm512_and_si512(v, low4), eight));
        _mm512_store_si512(unpacked[half] + pair * 128 + 64,
                           _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(v, 4), low4), eight));
      }
    }
    PairPrefetch prefetch(panels + (b + 2) * panel_bytes, prefetch_end, 2 * panel_bytes, mp / 16 * (kp / kBlockK));
    for (int64_t r = 0; r < mp; r += 16) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t k = 0; k < kp; k += kBlockK) {
        prefetch.next();
        _tile_loadd(4, hi + r * kp + k, kp);
        _tile_loadd(5, lo + r * kp + k, kp);
        _tile_loadd(6, unpacked[0] + k * kBlockN, 64);
        _tile_dpbssd(0, 4, 6);
        _tile_dpbssd(2, 5, 6);
        if (two_n) {
          _tile_loadd(7, unpacked[1] + k * kBlockN, 64);
          _tile_dpbssd(1, 4, 7);
          _tile_dpbssd(3, 5, 7);
        }
      }
      const int64_t at = r * ldc + (b - b0) * kBlockN;
      _tile_stored(0, c_hi + at, ldc_bytes);
      _tile_stored(2, c_lo + at, ldc_bytes);
      if (two_n) {
        _tile_stored(1, c_hi + at + kBlockN, ldc_bytes);
        _tile_stored(3, c_lo + at + kBlockN, ldc_bytes);
      }
    }
  }
}

CAM_JIT_AMX void amx_release() { _tile_release(); }
#endif  // CAM_JIT_X86

#if defined(CAM_JIT_X86)
// The W4A8 nibble split of one row q[0..k): hi = q >> 4 and lo = (q & 15) - 8 into hi[0..kp),
// lo[0..kp) (zeros from k on, kp a multiple of 64); returns {sum hi, sum lo}. Through the unsigned
// nibbles (q + 128) >> 4 = hi + 8 and q & 15 = lo + 8, whose sums vpsadbw takes.
CAM_JIT_AVX512 std::pair<int64_t, int64_t> split_row_nibbles(const int8_t* q, int64_t k, int64_t kp, int8_t* hi,
                                                             int8_t* lo) {
  const __m512i low4 = _mm512_set1_epi8(15), eight = _mm512_set1_epi8(8), zero = _mm512_setzero_si512();
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512i sum_hi = zero, sum_lo = zero;
  for (int64_t j = 0; j < kp; j += 64) {
    const __mmask64 mask = k - j >= 64 ? ~0ull : (k > j ? (1ull << (k - j)) - 1 : 0ull);
    const __m512i v = _mm512_maskz_loadu_epi8(mask, q + j);
    const __m512i uh = _mm512_and_si512(_mm512_srli_epi16(_mm512_xor_si512(v, flip), 4), low4);
    const __m512i ul = _mm512_and_si512(v, low4);
    _mm512_storeu_si512(hi + j, _mm512_maskz_sub_epi8(mask, uh, eight));
    _mm512_storeu_si512(lo + j, _mm512_maskz_sub_epi8(mask, ul, eight));
    sum_hi = _mm512_add_epi64(sum_hi, _mm512_sad_epu8(_mm512_maskz_mov_epi8(mask, uh), zero));
    sum_lo = _mm512_add_epi64(sum_lo, _mm512_sad_epu8(ul, zero));
  }
  return {_mm512_reduce_add_epi64(sum_hi) - 8 * k, _mm512_reduce_add_epi64(sum_lo) - 8 * k};
}
#endif

}  // namespace

namespace {

RowForm row_form(const PackedMatrix& w, GemmKernel kernel) {
  return w.int4 ? RowForm::kNibbles : (kernel == GemmKernel::kAmx ? RowForm::kS8 : RowForm::kU8);
}

int64_t padded_rows(int64_t m, GemmKernel kernel) {
  return kernel == GemmKernel::kAmx ? round_up(std::max<int64_t>(m, 1), 16) : m;
}

}  // namespace

int64_t packed_rows_bytes(const PackedMatrix& w, int64_t m, GemmKernel kernel) {
  const int64_t rows = padded_rows(m, kernel);
  if (row_form(w, kernel) != RowForm::kNibbles) return round_up(rows * w.kp, 64);
  return 2 * rows * w.kp + round_up(2 * rows * 4, 64);  // kp is a multiple of 64
}

PackedRows packed_rows(const PackedMatrix& w, int64_t m, GemmKernel kernel, void* memory) {
  TORCH_CHECK(m >= 0 && (is_vnni(kernel) || kernel == GemmKernel::kAmx),
              "cam_jit packed_rows: m must be >= 0 and the kernel packed, got ", m);
  PackedRows out;
  out.m = m;
  out.k = w.k;
  out.kp = w.kp;
  out.padded_rows = padded_rows(m, kernel);
  out.form = row_form(w, kernel);
  const int64_t plane = out.padded_rows * w.kp;
  out.a = static_cast<int8_t*>(memory);
  std::memset(out.a + m * w.kp, 0, plane - m * w.kp);
  if (out.form == RowForm::kNibbles) {
#if defined(CAM_JIT_X86)
    out.b = out.a + plane;
    std::memset(out.b + m * w.kp, 0, plane - m * w.kp);
    out.sum8 = reinterpret_cast<int32_t*>(out.b + plane);
    std::memset(out.sum8, 0, 2 * out.padded_rows * sizeof(int32_t));
#else
    TORCH_CHECK(false, "cam_jit packed_rows: no int4 kernel on this architecture");
#endif
  }
  return out;
}

PackedRows packed_rows(const PackedMatrix& w, int64_t m, GemmKernel kernel) {
  at::Tensor owner = at::empty({std::max<int64_t>(packed_rows_bytes(w, m, kernel), 64)},
                               at::TensorOptions().dtype(at::kChar));
  PackedRows out = packed_rows(w, m, kernel, owner.data_ptr());
  out.owner = std::move(owner);
  return out;
}

void set_row(const PackedRows& rows, int64_t r, const int8_t* q) {
  const int64_t kp = rows.kp, k = rows.k;
  int8_t* a = rows.a + r * kp;
  if (rows.form != RowForm::kNibbles) {
    const int8_t flip = rows.form == RowForm::kU8 ? static_cast<int8_t>(0x80) : 0;
    for (int64_t j = 0; j < k; ++j) a[j] = static_cast<int8_t>(q[j] ^ flip);
    std::memset(a + k, 0, kp - k);
    return;
  }
#if defined(CAM_JIT_X86)
  const auto [sum_hi, sum_lo] = split_row_nibbles(q, k, kp, a, rows.b + r * kp);
  rows.sum8[r] = static_cast<int32_t>(8 * sum_hi);
  rows.sum8[rows.padded_rows + r] = static_cast<int32_t>(8 * sum_lo);
#endif
}

int64_t vnni_groups(const PackedMatrix& w) { return (w.np / kBlockN + kVnniNr - 1) / kVnniNr; }

void vnni_group(const PackedRows& rows, const PackedMatrix& w, int64_t g, int32_t* acc, int32_t* lo_acc,
                int64_t ld, GemmKernel kernel, VnniNext next) {
#if defined(CAM_JIT_X86)
  const int64_t m = rows.m;
  const int64_t b = g * kVnniNr;
  const int nr = static_cast<int>(std::min<int64_t>(kVnniNr, w.np / kBlockN - b));
  const int64_t ncols = std::min<int64_t>(nr * kBlockN, w.n - b * kBlockN);
  const int64_t panel_bytes = vnni_panel_bytes(w);
  const uint8_t* panel = w.panel.data_ptr<uint8_t>() + b * panel_bytes;
  // After each row block but the last comes this group again (kVnniL1: its panels back from L2 into
  // L1), after the last the thread's next group when it is of the same kind.
  const PanelPrefetch again{panel, panel_bytes, panel, panel_bytes};
  PanelPrefetch last = again;
  const uint8_t* next_group = nullptr;
  int64_t next_group_bytes = 0;
  if (next.w != nullptr) {
    const int64_t next_panel_bytes = vnni_panel_bytes(*next.w);
    const int64_t next_b = next.g * kVnniNr;
    next_group = next.w->panel.data_ptr<uint8_t>() + next_b * next_panel_bytes;
    next_group_bytes = std::min<int64_t>(kVnniNr, next.w->np / kBlockN - next_b) * next_panel_bytes;
    if (next.w->int4 == w.int4) {
      last.next = next_group;
      last.next_bytes = next_panel_bytes;
    }
  }
  const int64_t steps = w.kp / (w.int4 ? 8 : 4);  // k steps of a row block, a panel line each
  // kVnniL1: every row block prefetches into L1. kVnni: a lone row block streams int8 panels with the
  // hardware prefetcher alone and int4 panels into L2; of several row blocks the first prefetches
  // into L1 (the others find the panels in L2).
  const int64_t rows_per_block = w.int4 ? kVnniMrI4 : kVnniMrI8;
  auto block_ahead = [&](int64_t r) {
    if (kernel == GemmKernel::kVnniL1) return Ahead::kL1;
    if (r > 0) return Ahead::kNone;
    if (m > rows_per_block) return Ahead::kL1;
    return w.int4 ? Ahead::kL2 : Ahead::kNone;
  };
  // Row block i (at row r, `rows_per_block` apart): `last`, or `again` with its stretch of the next group.
  auto block_prefetch = [&](int64_t r, int mr) {
    if (r + mr == m) return last;
    PanelPrefetch p = again;
    const int64_t at = r / rows_per_block * steps * 64;
    if (at < next_group_bytes) {
      p.l2 = next_group + at;
      p.l2_steps = std::min<int64_t>(steps, (next_group_bytes - at) / 64);
    }
    return p;
  };
  if (!w.int4) {
    const uint8_t* a = reinterpret_cast<const uint8_t*>(rows.a);
    const int32_t* comp = w.comp.data_ptr<int32_t>() + b * kBlockN;
    for (int64_t r = 0; r < m; r += kVnniMrI8) {
      const int mr = static_cast<int>(std::min<int64_t>(kVnniMrI8, m - r));
      dispatch_block<kVnniMrI8, kVnniNr, VnniI8>(mr, nr, block_ahead(r), a + r * w.kp, w.kp,
                                                 block_prefetch(r, mr), steps, comp, acc + r * ld, ld,
                                                 ncols);
    }
    return;
  }
  const int8_t* hi = rows.a;
  const int8_t* lo = rows.b;
  const int32_t* hi_sum8 = rows.sum8;
  const int32_t* lo_sum8 = hi_sum8 + m;
  for (int64_t r = 0; r < m; r += kVnniMrI4) {
    const int mr = static_cast<int>(std::min<int64_t>(kVnniMrI4, m - r));
    dispatch_block<kVnniMrI4, kVnniNr, VnniI4>(mr, nr, block_ahead(r), hi + r * w.kp, lo + r * w.kp, w.kp,
                                               block_prefetch(r, mr), steps, hi_sum8 + r, lo_sum8 + r,
                                               acc + r * ld, lo_acc + r * ld, ld, ncols);
  }
#else
  TORCH_CHECK(false, "cam_jit vnni_group: no VNNI kernel on this architecture");
#endif
}

void amx_group(const PackedRows& rows, const PackedMatrix& w, int64_t g, int32_t* acc, int32_t* lo_acc, int64_t ld) {
#if defined(CAM_JIT_X86)
  const int64_t mp = rows.padded_rows;
  const int64_t blocks = w.np / kBlockN;
  const int64_t b0 = g * kVnniNr, b1 = std::min<int64_t>(b0 + kVnniNr, blocks);
  const uint8_t* panels = w.panel.data_ptr<uint8_t>();
  const uint8_t* end = panels + w.panel.nbytes();
  amx_configure();
  if (!w.int4) {
    amx_i8_blocks(rows.a, mp, panels, w.kp, b0, b1, end, acc, ld);
  } else {
    thread_local KeptBuffer unpacked;  // a pair of int4 panels widened to int8
    amx_i4_blocks(rows.a, rows.b, mp, panels, w.kp, b0, b1, end, acc, lo_acc, ld,
                  unpacked.get<uint8_t>(2 * w.kp * kBlockN));
  }
  amx_release();
#else
  TORCH_CHECK(false, "cam_jit amx_group: no AMX kernel on this architecture");
#endif
}

namespace {

// q [M, K] int8 contiguous (checked by the caller, K == w.k) as the rows of `kernel` against w.
PackedRows rows_of(const at::Tensor& q, const PackedMatrix& w, GemmKernel kernel) {
  PackedRows rows = packed_rows(w, q.size(0), kernel);
  const int8_t* src = q.data_ptr<int8_t>();
  for (int64_t r = 0; r < rows.m; ++r) set_row(rows, r, src + r * w.k);
  return rows;
}

}  // namespace

at::Tensor packed_matmul(const at::Tensor& q, const PackedMatrix& w, GemmKernel kernel) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar && q.is_contiguous() && q.size(1) == w.k,
              "cam_jit packed_matmul: q must be contiguous int8 [M, ", w.k, "], got ", q.sizes());
  TORCH_CHECK(kernel != GemmKernel::kIntMm && gemm_available(static_cast<int>(kernel)),
              "cam_jit packed_matmul: kernel unavailable");
  const int64_t m = q.size(0);
  const int64_t parts = w.int4 ? 2 : 1;
#if defined(CAM_JIT_X86)
  if (is_vnni(kernel)) {
    at::Tensor out = at::empty({parts * m, w.n}, q.options().dtype(at::kInt));
    if (m == 0) return out;
    const PackedRows rows = rows_of(q, w, kernel);
    int32_t* o = out.data_ptr<int32_t>();
    at::parallel_for(0, vnni_groups(w), 1, [&](int64_t g0, int64_t g1) {
      for (int64_t g = g0; g < g1; ++g) {
        vnni_group(rows, w, g, o + g * kVnniGroupColumns, o + m * w.n + g * kVnniGroupColumns, w.n,
                   kernel, g + 1 < g1 ? VnniNext{&w, g + 1} : VnniNext{});
      }
    });
    return out;
  }
  // AMX: the column groups into a buffer of padded rows, then the [M, N] corner of it.
  const int64_t groups = vnni_groups(w);
  if (m == 0) return at::empty({0, w.n}, q.options().dtype(at::kInt));
  const PackedRows rows = rows_of(q, w, kernel);
  const int64_t mp = rows.padded_rows, ld = groups * kVnniGroupColumns;
  at::Tensor c = at::empty({parts, mp, ld}, q.options().dtype(at::kInt));
  int32_t* cp = c.data_ptr<int32_t>();
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      amx_group(rows, w, g, cp + g * kVnniGroupColumns, cp + mp * ld + g * kVnniGroupColumns, ld);
    }
  });
  return c.narrow(1, 0, m).narrow(2, 0, w.n).contiguous().view({parts * m, w.n});
#else
  TORCH_CHECK(false, "cam_jit packed_matmul: no packed kernel on this architecture");
#endif
}

namespace {

// ---------------------------------------------------------------------------------------------
// Internal ops: the variant switch, prepacking ahead of time, the cache's size.

std::vector<std::string> kernel_variants() {
  std::vector<std::string> out;
  for (int v = 0; v < kGemmCount; ++v)
    if (gemm_available(v)) out.push_back(std::string("gemm:") + kGemmNames[v]);
  for (int v = 0; v < kVectorCount; ++v)
    if (vector_available(v)) out.push_back(std::string("vector:") + kVectorNames[v]);
  return out;
}

// Sets the variants ("" keeps one) and returns the previous settings [gemm, vector].
std::vector<std::string> select_kernels(const std::string& gemm, const std::string& vector) {
  std::vector<std::string> previous = {setting_name(gemm_setting().load(), kGemmNames),
                                       setting_name(vector_setting().load(), kVectorNames)};
  const int g = gemm.empty() ? gemm_setting().load() : parse_variant(gemm, kGemmNames, kGemmCount, gemm_available, "GEMM");
  const int v = vector.empty() ? vector_setting().load()
                               : parse_variant(vector, kVectorNames, kVectorCount, vector_available, "vector");
  gemm_setting().store(g);
  vector_setting().store(v);
  return previous;
}

// Packs `w` into the cache (int4: int32 words of packed int4) and returns the packed bytes.
int64_t prepack_weight(const at::Tensor& w, bool int4) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == (int4 ? at::kInt : at::kChar),
              "_cam_jit_cpu::prepack_weight: w must be a 2-D ", int4 ? "int32 (packed int4)" : "int8",
              " matrix, got ", w.scalar_type(), " ", w.sizes());
  const auto p = packed_matrix(w, int4);
  return p->panel.nbytes() + (p->comp.defined() ? p->comp.nbytes() : 0);
}

// acc = q . w with GEMM variant `kernel` (tests compare the variants; "auto": the one the expert FFN
// picks for M rows): q [M, K] int8, w int8 [K, N] or (int4) int32 [K, N/8]. Returns int32 [M, N]
// (int4: [2M, N], hi rows then lo rows).
at::Tensor int8_matmul(const at::Tensor& q, const at::Tensor& w, bool int4, const std::string& kernel) {
  check_cpu(q, "q");
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar, "_cam_jit_cpu::int8_matmul: q must be a 2-D int8 "
              "matrix, got ", q.scalar_type(), " ", q.sizes());
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == (int4 ? at::kInt : at::kChar) && w.size(0) == q.size(1),
              "_cam_jit_cpu::int8_matmul: w must be a 2-D ", int4 ? "int32 (packed int4)" : "int8", " [",
              q.size(1), ", *] matrix, got ", w.scalar_type(), " ", w.sizes());
  const int v = parse_variant(kernel, kGemmNames, kGemmCount, gemm_available, "GEMM");
  const GemmKernel k = v == kAuto ? gemm_kernel(q.size(0)) : static_cast<GemmKernel>(v);
  TORCH_CHECK(k != GemmKernel::kIntMm, "_cam_jit_cpu::int8_matmul: kernel must be a packed one ('vnni', "
              "'vnni_l1', 'amx', or 'auto' where it picks one), got '", kernel, "'");
  return packed_matmul(q.contiguous(), *packed_matrix(w, int4), k);
}

// Bytes held by the prepack cache (entries of dead storages dropped first); `clear` empties it.
int64_t prepack_cache_bytes(bool clear) {
  PrepackCache& c = cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  if (clear) c.entries.clear();
  c.drop_expired();
  return c.bytes();
}

}  // namespace
}  // namespace cam_jit_cpu

TORCH_LIBRARY_FRAGMENT(_cam_jit_cpu, m) {
  m.def("kernel_variants() -> str[]", &cam_jit_cpu::kernel_variants);
  m.def("select_kernels(str gemm, str vector) -> str[]", &cam_jit_cpu::select_kernels);
  m.def("prepack_weight(Tensor w, bool int4) -> int");
  m.def("int8_matmul(Tensor q, Tensor w, bool int4, str kernel) -> Tensor");
  m.def("prepack_cache_bytes(bool clear) -> int", &cam_jit_cpu::prepack_cache_bytes);
  m.def("exp_direct(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(_cam_jit_cpu, CPU, m) {
  m.impl("prepack_weight", &cam_jit_cpu::prepack_weight);
  m.impl("int8_matmul", &cam_jit_cpu::int8_matmul);
  m.impl("exp_direct", &cam_jit_cpu::exp_direct_op);
}
