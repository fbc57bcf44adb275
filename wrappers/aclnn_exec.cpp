// The aclnn execution helper (see aclnn_exec.h).
#include "aclnn_exec.h"

#include <dlfcn.h>

#include <map>
#include <mutex>
#include <sstream>
#include <utility>

namespace cam_jit_npu {
namespace {

struct Library {
  std::string path;
  void* handle = nullptr;  // null when dlopen failed
  std::string error;       // dlopen's message then
};

struct TensorApi {
  CreateTensorFn create = nullptr;
  CreateTensorListFn create_list = nullptr;
  DestroyTensorFn destroy = nullptr;
  DestroyTensorListFn destroy_list = nullptr;
  RecentErrMsgFn recent_error = nullptr;  // optional (aclGetRecentErrMsg)
  DestroyExecutorFn destroy_executor = nullptr;  // optional (aclDestroyAclOpExecutor)
};

std::mutex g_mutex;
std::vector<Library> g_libraries;  // search order, opened on first use
std::map<std::string, std::string> g_aclnn;  // op -> aclnn stem
bool g_opened = false;
TensorApi g_api;
bool g_api_resolved = false;

std::string searched() {
  std::ostringstream out;
  out << "libraries searched, in order: ";
  if (g_libraries.empty()) out << "none (no opp vendor, no CANN libopapi.so was found)";
  for (size_t i = 0; i < g_libraries.size(); ++i) {
    const Library& lib = g_libraries[i];
    out << (i ? ", " : "") << lib.path;
    if (!lib.handle) out << " (cannot load: " << lib.error << ")";
  }
  return out.str();
}

void open_all() {  // caller holds g_mutex
  if (g_opened) return;
  for (Library& lib : g_libraries) {
    lib.handle = dlopen(lib.path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!lib.handle) {
      const char* e = dlerror();
      lib.error = e ? e : "unknown dlopen error";
    }
  }
  g_opened = true;
}

// The first library in search order exporting `symbol` (nullptr, "" when none).
std::pair<void*, std::string> find_symbol(const std::string& symbol) {
  for (const Library& lib : g_libraries) {
    if (!lib.handle) continue;
    dlerror();
    void* p = dlsym(lib.handle, symbol.c_str());
    if (p) return {p, lib.path};
  }
  return {nullptr, ""};
}

// aclGetRecentErrMsg: from the configured libraries, else the process's global namespace, else
// CANN's libascendcl.so (where CANN defines it; the opapi libraries need not export it).
RecentErrMsgFn recent_error_function() {  // caller holds g_mutex
  const char* name = "aclGetRecentErrMsg";
  void* p = find_symbol(name).first;
  if (!p) p = dlsym(RTLD_DEFAULT, name);
  if (!p) {
    static void* ascendcl = dlopen("libascendcl.so", RTLD_NOW | RTLD_LOCAL);
    if (ascendcl) p = dlsym(ascendcl, name);
  }
  return reinterpret_cast<RecentErrMsgFn>(p);
}

[[noreturn]] void fail_status(const std::string& op, const std::string& function,
                              const std::string& library, AclStatus status) {
  const char* detail = g_api.recent_error ? g_api.recent_error() : nullptr;
  std::string where;
  {
    std::lock_guard<std::mutex> guard(g_mutex);
    where = searched();
  }
  TORCH_CHECK(false, "cam_jit NPU op ", op, ": aclnn function ", function, " returned status ",
              status, " (library ", library, "; ", where, ")",
              detail && *detail ? std::string("; CANN says: ") + detail : std::string());
}

template <typename Fn>
Fn required(const std::string& op, const char* name) {
  void* p = find_symbol(name).first;
  TORCH_CHECK(p, "cam_jit NPU op ", op, ": the aclnn tensor API function ", name,
              " was not found; ", searched(),
              ". It is part of CANN (libnnopbase.so): source CANN's set_env.sh");
  return reinterpret_cast<Fn>(p);
}

const TensorApi& api(const std::string& op) {
  std::lock_guard<std::mutex> guard(g_mutex);
  if (!g_api_resolved) {
    open_all();
    TensorApi a;
    a.create = required<CreateTensorFn>(op, "aclCreateTensor");
    a.create_list = required<CreateTensorListFn>(op, "aclCreateTensorList");
    a.destroy = required<DestroyTensorFn>(op, "aclDestroyTensor");
    a.destroy_list = required<DestroyTensorListFn>(op, "aclDestroyTensorList");
    a.recent_error = recent_error_function();
    a.destroy_executor =
        reinterpret_cast<DestroyExecutorFn>(find_symbol("aclDestroyAclOpExecutor").first);
    g_api = a;
    g_api_resolved = true;
  }
  return g_api;
}

}  // namespace

void configure_aclnn(const std::vector<std::string>& libraries,
                     const std::vector<std::string>& ops, const std::vector<std::string>& aclnn) {
  TORCH_CHECK(ops.size() == aclnn.size(), "cam_jit NPU configure: ", ops.size(), " ops but ",
              aclnn.size(), " aclnn names");
  std::lock_guard<std::mutex> guard(g_mutex);
  for (Library& lib : g_libraries) {
    if (lib.handle) dlclose(lib.handle);
  }
  g_libraries.clear();
  for (const std::string& path : libraries) g_libraries.push_back(Library{path});
  g_aclnn.clear();
  for (size_t i = 0; i < ops.size(); ++i) g_aclnn[ops[i]] = aclnn[i];
  g_opened = false;
  g_api_resolved = false;
}

int32_t acl_dtype(const std::string& op, const std::string& arg, c10::ScalarType dtype) {
  switch (dtype) {
    case c10::ScalarType::Float: return kAclFloat;
    case c10::ScalarType::Half: return kAclFloat16;
    case c10::ScalarType::Char: return kAclInt8;
    case c10::ScalarType::Int: return kAclInt32;
    case c10::ScalarType::Byte: return kAclUInt8;
    case c10::ScalarType::Short: return kAclInt16;
    case c10::ScalarType::Long: return kAclInt64;
    case c10::ScalarType::Double: return kAclDouble;
    case c10::ScalarType::Bool: return kAclBool;
    case c10::ScalarType::BFloat16: return kAclBFloat16;
    default:
      TORCH_CHECK(false, "cam_jit NPU op ", op, ": argument '", arg, "': dtype ", dtype,
                  " has no ACL equivalent in cam_jit (expected float32, float16, bfloat16, "
                  "float64, int8, uint8, int16, int32, int64 or bool)");
  }
}

AclnnCall::AclnnCall(std::string op, const at::Tensor& device_like)
    : op_(std::move(op)), like_(device_like) {}

AclnnCall::~AclnnCall() = default;

void AclnnCall::Handles::release() {
  if (tensors.empty() && lists.empty()) return;
  const TensorApi& a = g_api;  // resolved: handles exist only after api() succeeded
  for (AclTensorList* l : lists) a.destroy_list(l);
  for (AclTensor* t : tensors) a.destroy(t);
  lists.clear();
  tensors.clear();
}

AclTensor* AclnnCall::make(const std::string& arg, const at::Tensor& t) {
  const TensorApi& a = api(op_);
  const int32_t dtype = acl_dtype(op_, arg, t.scalar_type());
  const std::vector<int64_t> storage = storage_dims(t);
  const at::IntArrayRef sizes = t.sizes();
  const at::IntArrayRef strides = t.strides();
  void* base = const_cast<void*>(t.storage().data());
  AclTensor* handle = a.create(sizes.data(), sizes.size(), dtype, strides.data(),
                               t.storage_offset(), storage_format(t), storage.data(),
                               storage.size(), base);
  TORCH_CHECK(handle, "cam_jit NPU op ", op_, ": aclCreateTensor failed for argument '", arg,
              "' (shape ", sizes, ", dtype ", t.scalar_type(), ")");
  return handle;
}

const AclTensor* AclnnCall::tensor(const std::string& arg, const at::Tensor& t) {
  TORCH_CHECK(t.defined(), "cam_jit NPU op ", op_, ": argument '", arg, "' is undefined");
  AclTensor* handle = make(arg, t);
  handles_->tensors.push_back(handle);
  return handle;
}

const AclTensor* AclnnCall::optional(const std::string& arg, const c10::optional<at::Tensor>& t) {
  return (t.has_value() && t->defined()) ? tensor(arg, *t) : nullptr;
}

const AclTensorList* AclnnCall::list(const std::string& arg, at::TensorList ts) {
  const TensorApi& a = api(op_);
  std::vector<AclTensor*> items;
  items.reserve(ts.size());
  try {
    for (size_t i = 0; i < ts.size(); ++i) {
      items.push_back(make(arg + "[" + std::to_string(i) + "]", ts[i]));
    }
  } catch (...) {
    for (AclTensor* t : items) a.destroy(t);
    throw;
  }
  AclTensorList* handle = a.create_list(items.data(), items.size());
  if (!handle) {
    for (AclTensor* t : items) a.destroy(t);
    TORCH_CHECK(false, "cam_jit NPU op ", op_, ": aclCreateTensorList failed for argument '",
                arg, "' (", ts.size(), " tensors)");
  }
  handles_->lists.push_back(handle);
  return handle;
}

void AclnnCall::resolve() {
  std::lock_guard<std::mutex> guard(g_mutex);
  auto it = g_aclnn.find(op_);
  TORCH_CHECK(it != g_aclnn.end(), "cam_jit NPU op ", op_,
              ": no aclnn entry point is configured for it (cam_jit.ascend.npu_ops configures "
              "the library from the operator registry before the first call)");
  aclnn_ = it->second;
  open_all();
  const std::string ws_name = aclnn_ + "GetWorkspaceSize";
  auto found = find_symbol(ws_name);
  TORCH_CHECK(found.first, "cam_jit NPU op ", op_, ": aclnn function ", ws_name,
              " not found; ", searched(),
              ". Install an opp package with this operator (python -m cam_jit doctor says which)");
  library_ = found.second;
  void* handle = nullptr;
  for (const Library& lib : g_libraries) {
    if (lib.path == library_) handle = lib.handle;
  }
  dlerror();
  launch_ = reinterpret_cast<LaunchFn>(dlsym(handle, aclnn_.c_str()));
  TORCH_CHECK(launch_, "cam_jit NPU op ", op_, ": aclnn function ", aclnn_, " not found in ",
              library_, ", which exports ", ws_name, "; the opp package is broken (reinstall it)");
  get_workspace_ = found.first;
}

void AclnnCall::check(AclStatus status, const std::string& function) {
  if (status != 0) fail_status(op_, function, library_, status);
}

void AclnnCall::launch(uint64_t workspace_size, AclOpExecutor* executor) {
  at::Tensor workspace;
  void* workspace_ptr = nullptr;
  if (workspace_size > 0) {
    try {
      workspace = allocate_workspace(like_, workspace_size);
    } catch (...) {  // the executor is consumed only by a launch: release it here instead
      if (g_api.destroy_executor) g_api.destroy_executor(executor);
      throw;
    }
    workspace_ptr = workspace.data_ptr();
  }
  // Only the workspace's address travels with the launch, as in op-plugin: its memory returns to
  // the stream-ordered caching allocator here, and work queued later on the stream runs after it.
  void* stream = current_stream(like_);
  std::shared_ptr<Handles> handles = std::move(handles_);
  handles_ = std::make_shared<Handles>();
  enqueue(aclnn_, [fn = launch_, workspace_ptr, workspace_size, executor, stream, handles,
                   op = op_, aclnn = aclnn_, library = library_]() -> int {
    const AclStatus status = fn(workspace_ptr, workspace_size, executor, stream);
    handles->release();
    if (status != 0) fail_status(op, aclnn, library, status);
    return 0;
  });
}

}  // namespace cam_jit_npu
