// The NPU symmetric heap of cam_jit.FusedDeepMoeBuffer (docs/semantics.md §5.1) on Ascend SHMEM: this PE
// sets the bootstrap's TLS (off unless TLS settings are given: SHMEM releases before Feb 2026
// otherwise demand certificates; UMDK's buffer turns it off the same way), initialises SHMEM
// (aclshmemx_init_attr, bootstrap at ip_port), then allocates from the symmetric heap the 2 MiB
// ext-info region and the workspace (memsize - 2 MiB). The buffer then calls the
// fused_deep_moe wrapper with the base ABI, ext_info, shmem_workspace and memsize - 2 MiB (§7.2).
//
// Built only with SHMEM: cam_jit/ascend/build.py adds this file, -DCAM_JIT_WITH_SHMEM and
// SHMEM's include/lib flags when SHMEM_HOME_PATH holds shmem.h. The guard keeps the file an empty
// translation unit for builders that take every wrapper (tests/test_npu_marshalling.py).
#ifdef CAM_JIT_WITH_SHMEM
#include <shmem.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace cam_jit_npu {
namespace {

constexpr int64_t kExtInfoBytes = 2 * 1024 * 1024;  // docs/semantics.md §5.1
bool g_active = false;  // SHMEM is per process: one initialised buffer at a time

// SHMEM for PE `rank` of `num_ranks` with a `memsize`-byte heap, bootstrapped at `ip_port`
// ("tcp://host:port") with TLS off, or on with `tls_info` (SHMEM's TLS settings text) when it is
// not empty; then the two allocations. Returns their device addresses [ext_info,
// shmem_workspace]. RuntimeError texts follow docs/semantics.md §5.1.
std::vector<int64_t> zb_shmem_init(int64_t rank, int64_t num_ranks, int64_t memsize,
                                   const std::string& ip_port, const std::string& tls_info) {
  TORCH_CHECK(!g_active, "FusedDeepMoeBuffer.init: SHMEM is already initialised in this process by "
              "another buffer; close() it first (one NPU buffer per process)");
  TORCH_CHECK(0 <= rank && rank < num_ranks, "FusedDeepMoeBuffer.init: argument 'rank': expected "
              "0 <= rank < num_ranks (", num_ranks, "), got ", rank);
  TORCH_CHECK(memsize > kExtInfoBytes, "FusedDeepMoeBuffer.init: argument 'memsize': expected more "
              "than ", kExtInfoBytes, " bytes, got ", memsize);
  aclshmemx_init_attr_t attributes{};
  TORCH_CHECK(ip_port.size() < sizeof(attributes.ip_port), "shmem_set_attr failed: ip_port '",
              ip_port, "' is longer than ", sizeof(attributes.ip_port) - 1, " characters");
  attributes.my_pe = static_cast<int>(rank);
  attributes.n_pes = static_cast<int>(num_ranks);
  attributes.local_mem_size = static_cast<uint64_t>(memsize);
  std::memcpy(attributes.ip_port, ip_port.c_str(), ip_port.size() + 1);
  int status = tls_info.empty()
                   ? aclshmemx_set_conf_store_tls(false, nullptr, 0)
                   : aclshmemx_set_conf_store_tls(true, tls_info.c_str(),
                                                  static_cast<uint32_t>(tls_info.size()));
  TORCH_CHECK(status == 0, "FusedDeepMoeBuffer.init: aclshmemx_set_conf_store_tls(",
              tls_info.empty() ? "false" : "true", ") returned ", status);
  status = aclshmemx_init_attr(ACLSHMEMX_INIT_WITH_DEFAULT, &attributes);
  TORCH_CHECK(status == 0, "shmem_init_attr failed (aclshmemx_init_attr returned ", status,
              " for PE ", rank, " of ", num_ranks, " at ", ip_port, ")");
  if (aclshmemx_init_status() != ACLSHMEM_STATUS_IS_INITIALIZED) {
    aclshmem_finalize();
    TORCH_CHECK(false, "shmem not initialized");
  }
  void* ext_info = aclshmem_malloc(static_cast<size_t>(kExtInfoBytes));
  if (ext_info == nullptr) {
    aclshmem_finalize();
    TORCH_CHECK(false, "aclshmem_malloc ext_info failed");
  }
  void* workspace = aclshmem_malloc(static_cast<size_t>(memsize - kExtInfoBytes));
  if (workspace == nullptr) {
    aclshmem_free(ext_info);
    aclshmem_finalize();
    TORCH_CHECK(false, "aclshmem_malloc shmem_workspace failed (", memsize - kExtInfoBytes,
                " bytes from a ", memsize, "-byte heap: try a larger memsize)");
  }
  g_active = true;
  return {reinterpret_cast<int64_t>(ext_info), reinterpret_cast<int64_t>(workspace)};
}

// Frees both regions and finalises SHMEM (the buffer's close()).
void zb_shmem_finalize(int64_t ext_info, int64_t shmem_workspace) {
  TORCH_CHECK(g_active, "FusedDeepMoeBuffer.close: SHMEM is not initialised in this process");
  aclshmem_free(reinterpret_cast<void*>(shmem_workspace));
  aclshmem_free(reinterpret_cast<void*>(ext_info));
  g_active = false;
  int status = aclshmem_finalize();
  TORCH_CHECK(status == 0, "FusedDeepMoeBuffer.close: aclshmem_finalize returned ", status);
}

}  // namespace
}  // namespace cam_jit_npu

TORCH_LIBRARY_FRAGMENT(CAM_JIT_NPU_NS, m) {
  m.def("zb_shmem_init(int rank, int num_ranks, int memsize, str ip_port, str tls_info) -> int[]",
        &cam_jit_npu::zb_shmem_init);
  m.def("zb_shmem_finalize(int ext_info, int shmem_workspace) -> ()",
        &cam_jit_npu::zb_shmem_finalize);
}
#endif  // CAM_JIT_WITH_SHMEM
