// Device runtime hooks of the aclnn exec helper for tests, without torch_npu: CPU tensors stand in
// for NPU tensors, the "stream" is a fixed sentinel the simulated opapi records, workspaces come
// from at::empty on the CPU, and a storage can be tagged with a format and storage dims
// (cam_jit_test_set_storage_format, called with ctypes) to exercise the FRACTAL_NZ path. The
// task queue runs each launch at once, or, after cam_jit_test_defer_launches(1), keeps them until
// cam_jit_test_run_queue() runs them in order (as torch_npu's queue thread would, later). Compiled
// only by tests/test_npu_marshalling.py, with the wrappers, into namespace _cam_jit_npu_test.
#include "aclnn_exec.h"

#include <ATen/ops/empty.h>

#include <deque>
#include <map>
#include <mutex>
#include <utility>

namespace cam_jit_npu {
namespace {

std::mutex g_mutex;
std::map<const void*, std::pair<int32_t, std::vector<int64_t>>> g_formats;  // by storage base
bool g_defer = false;
std::deque<std::function<int()>> g_queue;

}  // namespace

void* current_stream(const at::Tensor&) { return reinterpret_cast<void*>(0x5EED); }

void enqueue(const std::string&, std::function<int()> launch) {
  {
    std::lock_guard<std::mutex> guard(g_mutex);
    if (g_defer) {
      g_queue.push_back(std::move(launch));
      return;
    }
  }
  TORCH_CHECK(launch() == 0, "the queued launch returned non-zero");
}

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

extern "C" void cam_jit_test_defer_launches(int32_t defer) {
  std::lock_guard<std::mutex> guard(cam_jit_npu::g_mutex);
  cam_jit_npu::g_defer = defer != 0;
}

// Runs the queued launches in order; returns how many ran, or -1 - index of the first that failed
// (the rest stay queued), its error text then in cam_jit_test_queue_error().
static std::string g_queue_error;
extern "C" int64_t cam_jit_test_run_queue() {
  int64_t ran = 0;
  for (;;) {
    std::function<int()> launch;
    {
      std::lock_guard<std::mutex> guard(cam_jit_npu::g_mutex);
      if (cam_jit_npu::g_queue.empty()) return ran;
      launch = std::move(cam_jit_npu::g_queue.front());
      cam_jit_npu::g_queue.pop_front();
    }
    try {
      if (launch() != 0) throw std::runtime_error("the queued launch returned non-zero");
    } catch (const std::exception& e) {
      g_queue_error = e.what();
      return -1 - ran;
    }
    ++ran;
  }
}

extern "C" const char* cam_jit_test_queue_error() { return g_queue_error.c_str(); }
