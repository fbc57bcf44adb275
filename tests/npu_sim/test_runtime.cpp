// Device runtime hooks of the aclnn exec helper for tests, without torch_npu: CPU tensors stand in
// for NPU tensors, the "stream" is a fixed sentinel the simulated opapi records, workspaces come
// from at::empty on the CPU, and a storage can be tagged with a format and storage dims
// (cam_jit_test_set_storage_format, called with ctypes) to exercise the FRACTAL_NZ path. Compiled
// only by tests/test_npu_marshalling.py, with the wrappers, into namespace _cam_jit_npu_test.
#include "aclnn_exec.h"

#include <ATen/ops/empty.h>

#include <map>
#include <mutex>
#include <utility>

namespace cam_jit_npu {
namespace {

std::mutex g_mutex;
std::map<const void*, std::pair<int32_t, std::vector<int64_t>>> g_formats;  // by storage base

}  // namespace

void* current_stream(const at::Tensor&) { return reinterpret_cast<void*>(0x5EED); }

at::Tensor allocate_workspace(const at::Tensor& like, uint64_t bytes) {
  return at::empty({static_cast<int64_t>(bytes)}, like.options().dtype(at::kByte));
}

int32_t storage_format(const at::Tensor& t) {
  std::lock_guard<std::mutex> guard(g_mutex);
  auto it = g_formats.find(t.storage().data());
  return it == g_formats.end() ? kAclFormatND : it->second.first;
}

std::vector<int64_t> storage_dims(const at::Tensor& t) {
  {
    std::lock_guard<std::mutex> guard(g_mutex);
    auto it = g_formats.find(t.storage().data());
    if (it != g_formats.end()) return it->second.second;
  }
  return {static_cast<int64_t>(t.storage().nbytes() / t.element_size())};
}

}  // namespace cam_jit_npu

// Tag the storage starting at `base` with `format` and storage dims; format < 0 clears all tags.
extern "C" void cam_jit_test_set_storage_format(uintptr_t base, int32_t format,
                                                const int64_t* dims, uint64_t ndims) {
  std::lock_guard<std::mutex> guard(cam_jit_npu::g_mutex);
  if (format < 0) {
    cam_jit_npu::g_formats.clear();
    return;
  }
  cam_jit_npu::g_formats[reinterpret_cast<const void*>(base)] = {
      format, std::vector<int64_t>(dims, dims + ndims)};
}
