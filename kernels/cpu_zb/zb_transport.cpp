// Shared-memory transport of cam_jit.FusedDeepMoeBuffer on CPU (docs/semantics.md §5.2, "CPU design").
//
// POSIX shared-memory segments (create / map / unmap / unlink), tensors viewing mapped memory,
// row puts straight into a peer's mapping, and completion flags: a writer stores its rows with
// plain stores, then publishes a 64-bit flag with a release store and rings the reader's doorbell
// (a futex); a reader acquire-loads the flag and may then read the rows. Waits spin briefly, then
// sleep on the doorbell, and give up after a time limit, returning the first flag that did not
// arrive so Python can name the missing rank. Linux only (futex, /dev/shm).
//
// Row format of a dispatched pair (`row_bytes` = H + 16 rounded up to 16):
//   [0, H) int8 quantised row | f32 scale | i32 local expert | i32 source position t*K+k | i32 call
// Every op that takes an address checks that what it touches lies inside a mapped segment.
// The data movers (put_rows, take_rows, put_results, pair_rows) only move bytes; the math stays in
// the CPU backend's kernels, so results are those of fused_deep_moe bit for bit.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

namespace cam_jit_cpu_zb {
namespace {

constexpr const char* kWho = "cam_jit FusedDeepMoeBuffer";

std::string os_error() { return std::strerror(errno); }

// Every live mapping made by map_segment (address -> size): the ops below take addresses, and
// each checks that the bytes it touches lie inside one of them, so no argument makes them touch
// memory that is not a segment.
std::mutex mappings_mutex;
std::map<int64_t, int64_t> mappings;

void check_inside(const char* op, int64_t addr, int64_t bytes) {
  TORCH_CHECK(bytes >= 0, kWho, ": ", op, ": negative length ", bytes);
  std::lock_guard<std::mutex> guard(mappings_mutex);
  auto it = mappings.upper_bound(addr);
  const bool inside = it != mappings.begin() && (--it, addr - it->first <= it->second - bytes);
  TORCH_CHECK(inside, kWho, ": ", op, ": ", bytes, " bytes at address ", addr,
              " are not inside a shared-memory segment mapped by map_segment");
}

// Creates (create=true: exclusively, sized `size`, zero-filled and sparse) or opens a POSIX
// shared-memory segment and maps it read/write. Returns the mapping address.
int64_t map_segment(const std::string& name, int64_t size, bool create) {
  TORCH_CHECK(size > 0, kWho, ": segment size must be positive, got ", size);
  const int fd = shm_open(name.c_str(), O_RDWR | (create ? (O_CREAT | O_EXCL) : 0), 0600);
  TORCH_CHECK(fd >= 0, kWho, ": cannot ", create ? "create" : "open", " shared-memory segment ", name, ": ",
              os_error(), create ? "" : " (is the peer rank on this host, with the same /dev/shm?)");
  std::string error;
  if (create) {
    if (ftruncate(fd, size) != 0) error = "ftruncate to " + std::to_string(size) + " bytes failed: " + os_error();
  } else {
    struct stat st;
    if (fstat(fd, &st) != 0) {
      error = "fstat failed: " + os_error();
    } else if (st.st_size < size) {
      error = "it has " + std::to_string(st.st_size) + " bytes, expected at least " + std::to_string(size);
    }
  }
  void* addr = MAP_FAILED;
  if (error.empty()) {
    addr = mmap(nullptr, static_cast<size_t>(size), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (addr == MAP_FAILED) error = "mmap of " + std::to_string(size) + " bytes failed: " + os_error();
  }
  close(fd);
  if (!error.empty()) {
    if (create) shm_unlink(name.c_str());
    TORCH_CHECK(false, kWho, ": shared-memory segment ", name, ": ", error);
  }
  std::lock_guard<std::mutex> guard(mappings_mutex);
  mappings[reinterpret_cast<int64_t>(addr)] = size;
  return reinterpret_cast<int64_t>(addr);
}

void unmap_segment(int64_t addr, int64_t size) {
  {
    std::lock_guard<std::mutex> guard(mappings_mutex);
    auto it = mappings.find(addr);
    TORCH_CHECK(it != mappings.end() && it->second == size, kWho, ": unmap_segment: no mapping of ", size,
                " bytes at address ", addr);
    mappings.erase(it);
  }
  TORCH_CHECK(munmap(reinterpret_cast<void*>(addr), static_cast<size_t>(size)) == 0, kWho,
              ": munmap failed: ", os_error());
}

// Removes a segment's name; true if it existed. Mappings stay valid until unmapped.
bool unlink_segment(const std::string& name) {
  if (shm_unlink(name.c_str()) == 0) return true;
  TORCH_CHECK(errno == ENOENT, kWho, ": shm_unlink(", name, ") failed: ", os_error());
  return false;
}

// A tensor viewing mapped memory (no ownership: valid while the mapping is).
at::Tensor region(int64_t addr, at::IntArrayRef size, at::ScalarType dtype) {
  int64_t bytes = c10::elementSize(dtype);
  for (const int64_t n : size) {
    TORCH_CHECK(n >= 0 && (n == 0 || bytes <= INT64_MAX / n), kWho, ": region: bad size ", size);
    bytes *= n;
  }
  check_inside("region", addr, bytes);
  return at::from_blob(reinterpret_cast<void*>(addr), size, at::TensorOptions().dtype(dtype));
}

// Index of the block holding row m, for blocks of counts[b] consecutive rows (starts: prefix sums).
int64_t block_of(const std::vector<int64_t>& starts, int64_t m) {
  return static_cast<int64_t>(std::upper_bound(starts.begin(), starts.end(), m) - starts.begin()) - 1;
}

std::vector<int64_t> prefix(at::IntArrayRef counts) {
  std::vector<int64_t> starts(counts.size(), 0);
  for (size_t i = 1; i < counts.size(); ++i) starts[i] = starts[i - 1] + counts[i - 1];
  return starts;
}

// The checks every data mover makes on its counts: non-negative, at most `cap` each (cap < 0:
// unbounded); returns their prefix sums.
std::vector<int64_t> checked_prefix(const char* op, at::IntArrayRef counts, int64_t cap) {
  for (size_t i = 0; i < counts.size(); ++i) {
    TORCH_CHECK(counts[i] >= 0 && (cap < 0 || counts[i] <= cap), kWho, ": ", op, ": count ", counts[i], " of rank ",
                i, " outside [0, ", cap < 0 ? INT64_MAX : cap, "]");
  }
  return prefix(counts);
}

// Dispatch: writes the P routed pairs into their destinations. Pairs are in route order (sorted
// by global expert, so grouped by destination rank d = expert / local_experts, counts[d] each);
// the j-th pair for rank d goes to address dest[d] + j * row_bytes as
// int8 q[i] [H] | f32 scale[i] | i32 expert % local_experts | i32 pos[i] | i32 seq (low 32 bits).
void put_rows(at::IntArrayRef dest, const at::Tensor& q, const at::Tensor& scale, const at::Tensor& expert,
              const at::Tensor& pos, at::IntArrayRef counts, int64_t local_experts, int64_t row_bytes, int64_t seq) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar && q.is_contiguous(), kWho, ": put_rows: q");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && expert.scalar_type() == at::kLong &&
                  pos.scalar_type() == at::kLong && scale.is_contiguous() && expert.is_contiguous() &&
                  pos.is_contiguous(),
              kWho, ": put_rows: scale/expert/pos dtypes");
  TORCH_CHECK(!dest.empty() && dest.size() == counts.size() && local_experts > 0, kWho, ": put_rows: lengths");
  const int64_t hidden = q.size(1);
  const int64_t pairs = q.size(0);
  TORCH_CHECK(row_bytes >= hidden + 16 && scale.numel() == pairs && expert.numel() == pairs && pos.numel() == pairs,
              kWho, ": put_rows: sizes");
  const std::vector<int64_t> starts = checked_prefix("put_rows", counts, -1);
  TORCH_CHECK(starts.back() + counts.back() == pairs, kWho, ": put_rows: counts do not sum to the pairs");
  for (size_t d = 0; d < dest.size(); ++d) check_inside("put_rows", dest[d], counts[d] * row_bytes);
  const int8_t* q_ptr = q.data_ptr<int8_t>();
  const float* s_ptr = scale.data_ptr<float>();
  const int64_t* e_ptr = expert.data_ptr<int64_t>();
  const int64_t* p_ptr = pos.data_ptr<int64_t>();
  const int32_t stamp = static_cast<int32_t>(seq);
  const int64_t grain = std::max<int64_t>(1, 65536 / row_bytes);
  at::parallel_for(0, pairs, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t d = block_of(starts, i);
      TORCH_CHECK(e_ptr[i] / local_experts == d && e_ptr[i] >= 0 && p_ptr[i] >= 0 && p_ptr[i] <= INT32_MAX, kWho,
                  ": put_rows: pair ", i, " (expert ", e_ptr[i], ", position ", p_ptr[i], ") is not for rank ", d);
      char* row = reinterpret_cast<char*>(dest[d]) + (i - starts[d]) * row_bytes;
      const int32_t local = static_cast<int32_t>(e_ptr[i] % local_experts);
      const int32_t position = static_cast<int32_t>(p_ptr[i]);
      std::memcpy(row, q_ptr + i * hidden, static_cast<size_t>(hidden));
      std::memcpy(row + hidden, s_ptr + i, 4);
      std::memcpy(row + hidden + 4, &local, 4);
      std::memcpy(row + hidden + 8, &position, 4);
      std::memcpy(row + hidden + 12, &stamp, 4);
    }
  });
}

// Receive: reads the rows that arrived in this rank's dispatch area (counts[s] rows from source s
// at rows s * cap ...), in received order (source-major), and groups them by local expert with a
// stable counting sort (the order torch.sort(stable=True) gives). Every row must carry call
// `seq`'s stamp (a count above what its source wrote finds an older row) and a local expert in
// range. Returns rows [M, H] int8, scale [M] f32, order [M] int64 (received index of each grouped
// row) and the count per local expert [local_experts] int64.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> take_rows(int64_t addr, at::IntArrayRef counts, int64_t cap,
                                                                     int64_t row_bytes, int64_t hidden,
                                                                     int64_t local_experts, int64_t seq) {
  TORCH_CHECK(hidden > 0 && row_bytes >= hidden + 16 && local_experts > 0 && cap >= 0 && !counts.empty(), kWho,
              ": take_rows: sizes");
  TORCH_CHECK(cap <= INT64_MAX / row_bytes / static_cast<int64_t>(counts.size()), kWho, ": take_rows: cap ", cap);
  const std::vector<int64_t> starts = checked_prefix("take_rows", counts, cap);
  check_inside("take_rows", addr, static_cast<int64_t>(counts.size()) * cap * row_bytes);
  const int64_t rows_in = starts.back() + counts.back();
  const char* area = reinterpret_cast<const char*>(addr);
  auto slot = [&](int64_t m) {
    const int64_t s = block_of(starts, m);
    return area + (s * cap + m - starts[s]) * row_bytes;
  };
  at::Tensor nums = at::zeros({local_experts}, at::TensorOptions().dtype(at::kLong));
  int64_t* n_ptr = nums.data_ptr<int64_t>();
  std::vector<int32_t> local(rows_in);
  const int32_t stamp = static_cast<int32_t>(seq);
  for (int64_t m = 0; m < rows_in; ++m) {
    int32_t row_stamp;
    std::memcpy(&row_stamp, slot(m) + hidden + 12, 4);
    TORCH_CHECK(row_stamp == stamp, kWho, ": rank ", block_of(starts, m), " announced ",
                counts[block_of(starts, m)], " rows but row ", m - starts[block_of(starts, m)],
                " is not from this call (stamp ", row_stamp, ", expected ", stamp, ")");
    std::memcpy(&local[m], slot(m) + hidden + 4, 4);
    TORCH_CHECK(local[m] >= 0 && local[m] < local_experts, kWho, ": received a row for local expert ", local[m],
                " outside [0, ", local_experts, ")");
    ++n_ptr[local[m]];
  }
  std::vector<int64_t> next(local_experts, 0);
  for (int64_t e = 1; e < local_experts; ++e) next[e] = next[e - 1] + n_ptr[e - 1];
  at::Tensor order = at::empty({rows_in}, at::TensorOptions().dtype(at::kLong));
  int64_t* o_ptr = order.data_ptr<int64_t>();
  for (int64_t m = 0; m < rows_in; ++m) o_ptr[next[local[m]]++] = m;
  at::Tensor rows = at::empty({rows_in, hidden}, at::TensorOptions().dtype(at::kChar));
  at::Tensor scale = at::empty({rows_in}, at::TensorOptions().dtype(at::kFloat));
  int8_t* r_ptr = rows.data_ptr<int8_t>();
  float* s_ptr = scale.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, 65536 / row_bytes);
  at::parallel_for(0, rows_in, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const char* from = slot(o_ptr[i]);
      std::memcpy(r_ptr + i * hidden, from, static_cast<size_t>(hidden));
      std::memcpy(s_ptr + i, from + hidden, 4);
    }
  });
  return {rows, scale, order, nums};
}

// Combine, expert side: writes expert results y [M, H] (grouped by local expert; row i is the
// order[i]-th received row) back to their sources: received row m, the j-th of the counts[s] rows
// from source s, goes to address dest[s] + j * (row bytes of y).
void put_results(at::IntArrayRef dest, const at::Tensor& y, const at::Tensor& order, at::IntArrayRef counts) {
  TORCH_CHECK(y.dim() == 2 && y.is_contiguous() && order.scalar_type() == at::kLong && order.is_contiguous() &&
                  order.numel() == y.size(0) && dest.size() == counts.size() && !counts.empty(),
              kWho, ": put_results: arguments");
  const std::vector<int64_t> starts = checked_prefix("put_results", counts, -1);
  const int64_t total = starts.back() + counts.back();
  TORCH_CHECK(total == y.size(0), kWho, ": put_results: counts sum to ", total, " but y has ", y.size(0), " rows");
  const int64_t row_bytes = y.size(1) * static_cast<int64_t>(y.element_size());
  for (size_t s = 0; s < dest.size(); ++s) check_inside("put_results", dest[s], counts[s] * row_bytes);
  const char* y_ptr = static_cast<const char*>(y.data_ptr());
  const int64_t* o_ptr = order.data_ptr<int64_t>();
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(row_bytes, 1));
  at::parallel_for(0, y.size(0), grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      TORCH_CHECK(o_ptr[i] >= 0 && o_ptr[i] < total, kWho, ": put_results: order entry ", o_ptr[i], " outside [0, ",
                  total, ")");
      const int64_t s = block_of(starts, o_ptr[i]);
      std::memcpy(reinterpret_cast<char*>(dest[s]) + (o_ptr[i] - starts[s]) * row_bytes, y_ptr + i * row_bytes,
                  static_cast<size_t>(row_bytes));
    }
  });
}

// Combine, source side: [batch, topk] int64, the combine-area row holding pair (t, k)'s result
// (d * cap + j for the j-th pair sent to rank d), -1 for a pair not routed. pos / expert: [P]
// route order (sorted by expert, so grouped by destination).
at::Tensor pair_rows(const at::Tensor& pos, const at::Tensor& expert, int64_t local_experts, int64_t cap, int64_t batch,
                     int64_t topk) {
  TORCH_CHECK(pos.scalar_type() == at::kLong && expert.scalar_type() == at::kLong && pos.is_contiguous() &&
                  expert.is_contiguous() && pos.numel() == expert.numel() && local_experts > 0 && cap >= 0 &&
                  batch >= 0 && topk >= 0,
              kWho, ": pair_rows: arguments");
  at::Tensor rows = at::full({batch, topk}, -1, at::TensorOptions().dtype(at::kLong));
  int64_t* out = rows.data_ptr<int64_t>();
  const int64_t* p_ptr = pos.data_ptr<int64_t>();
  const int64_t* e_ptr = expert.data_ptr<int64_t>();
  int64_t rank = -1, first = 0;
  for (int64_t p = 0; p < pos.numel(); ++p) {
    TORCH_CHECK(e_ptr[p] >= 0 && e_ptr[p] / local_experts >= rank, kWho, ": pair_rows: experts not sorted");
    const int64_t d = e_ptr[p] / local_experts;
    if (d != rank) rank = d, first = p;
    TORCH_CHECK(p_ptr[p] >= 0 && p_ptr[p] < batch * topk && p - first < cap, kWho,
                ": pair_rows: position out of range");
    out[p_ptr[p]] = d * cap + p - first;
  }
  return rows;
}

// Doorbells: one 32-bit futex word per rank (in its ext-info region) that every signal to that
// rank increments. A waiter whose flags are incomplete after a short spin sleeps in FUTEX_WAIT on
// its doorbell (a shared futex: the word is mapped by several processes) and is woken by the next
// signal, so waiting ranks leave the cores to the ranks they wait for.
void ring(int64_t bell) {
  auto* word = reinterpret_cast<uint32_t*>(bell);
  std::atomic_ref<uint32_t>(*word).fetch_add(1, std::memory_order_release);
  syscall(SYS_futex, word, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

constexpr int64_t kSlotWords = 8;  // a 64-byte control slot: flag, count, then up to 6 words of meta

void check_word(const char* op, int64_t addr, int64_t bytes) {
  TORCH_CHECK(addr % bytes == 0, kWho, ": ", op, ": misaligned address ", addr);
  check_inside(op, addr, bytes);
}

// Publishes to each control slot (int64 words: flag, count, meta...): stores counts[i] and the
// `meta` words, then `value` into the flag with a release store, so a reader that acquire-loads
// the flag sees the count, the meta and every row written before; then rings bells[i], the
// doorbell of the slot's rank.
void publish(at::IntArrayRef slots, at::IntArrayRef counts, at::IntArrayRef meta, int64_t value,
             at::IntArrayRef bells) {
  TORCH_CHECK(slots.size() == counts.size() && slots.size() == bells.size(), kWho, ": publish: lengths");
  TORCH_CHECK(static_cast<int64_t>(meta.size()) <= kSlotWords - 2, kWho, ": publish: at most ", kSlotWords - 2,
              " meta words, got ", meta.size());
  for (size_t i = 0; i < slots.size(); ++i) {
    check_word("publish", slots[i], kSlotWords * 8);
    check_word("publish", bells[i], 4);
  }
  for (size_t i = 0; i < slots.size(); ++i) {
    int64_t* slot = reinterpret_cast<int64_t*>(slots[i]);
    std::atomic_ref<int64_t>(slot[1]).store(counts[i], std::memory_order_relaxed);
    for (size_t w = 0; w < meta.size(); ++w) {
      std::atomic_ref<int64_t>(slot[2 + w]).store(meta[w], std::memory_order_relaxed);
    }
    std::atomic_ref<int64_t>(slot[0]).store(value, std::memory_order_release);
    ring(bells[i]);
  }
}

// Waits until every flag holds `value` (acquire loads), for at most timeout_s seconds: spins for
// 30 us, then sleeps on this rank's doorbell `bell` between checks. Returns -1 when all arrived,
// else the index of the first flag still missing.
int64_t wait_flags(at::IntArrayRef flags, int64_t value, double timeout_s, int64_t bell) {
  TORCH_CHECK(timeout_s >= 0 && timeout_s < 1e9, kWho, ": wait_flags: timeout ", timeout_s, " s");
  for (const int64_t flag : flags) check_word("wait_flags", flag, 8);
  check_word("wait_flags", bell, 4);
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  const auto deadline = start + std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(timeout_s));
  const auto spin_until = start + std::chrono::microseconds(30);
  auto* word = reinterpret_cast<uint32_t*>(bell);
  size_t next = 0;  // flags before `next` have arrived
  auto arrived = [&] {
    while (next < flags.size() &&
           std::atomic_ref<int64_t>(*reinterpret_cast<int64_t*>(flags[next])).load(std::memory_order_acquire) ==
               value) {
      ++next;
    }
    return next == flags.size();
  };
  for (;;) {
    if (arrived()) return -1;
    const auto now = clock::now();
    if (now >= deadline) return static_cast<int64_t>(next);
    if (now < spin_until) {
      cpu_relax();
      continue;
    }
    const uint32_t rung = std::atomic_ref<uint32_t>(*word).load(std::memory_order_acquire);
    if (arrived()) return -1;  // checked after reading the bell: a later signal changes the word
    const auto left = std::chrono::duration_cast<std::chrono::nanoseconds>(deadline - now).count();
    struct timespec ts = {static_cast<time_t>(left / 1000000000), static_cast<long>(left % 1000000000)};
    syscall(SYS_futex, word, FUTEX_WAIT, rung, &ts, nullptr, 0);
  }
}

}  // namespace
}  // namespace cam_jit_cpu_zb

TORCH_LIBRARY(_cam_jit_cpu_zb, m) {
  m.def("map_segment(str name, int size, bool create) -> int", &cam_jit_cpu_zb::map_segment);
  m.def("unmap_segment(int addr, int size) -> ()", &cam_jit_cpu_zb::unmap_segment);
  m.def("unlink_segment(str name) -> bool", &cam_jit_cpu_zb::unlink_segment);
  m.def("region(int addr, int[] size, ScalarType dtype) -> Tensor", &cam_jit_cpu_zb::region);
  m.def("put_rows(int[] dest, Tensor q, Tensor scale, Tensor expert, Tensor pos, int[] counts, int local_experts, "
        "int row_bytes, int seq) -> ()",
        &cam_jit_cpu_zb::put_rows);
  m.def("take_rows(int addr, int[] counts, int cap, int row_bytes, int hidden, int local_experts, int seq) "
        "-> (Tensor, Tensor, Tensor, Tensor)",
        &cam_jit_cpu_zb::take_rows);
  m.def("put_results(int[] dest, Tensor y, Tensor order, int[] counts) -> ()", &cam_jit_cpu_zb::put_results);
  m.def("pair_rows(Tensor pos, Tensor expert, int local_experts, int cap, int batch, int topk) -> Tensor",
        &cam_jit_cpu_zb::pair_rows);
  m.def("publish(int[] slots, int[] counts, int[] meta, int value, int[] bells) -> ()", &cam_jit_cpu_zb::publish);
  m.def("wait_flags(int[] flags, int value, float timeout_s, int bell) -> int", &cam_jit_cpu_zb::wait_flags);
}
