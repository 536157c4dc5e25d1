// host_pool.cpp: a pool of host buffers, keyed by exact size, that stage 3 attaches to the storages of its
// gathered parameter buckets (and takes back when a bucket is freed).
//
// Why: stage 3 allocates each bucket's full-size buffer before its module runs and frees it after, twice
// per step for every bucket. Through malloc that churn either keeps freed blocks resident (glibc raises its
// mmap threshold, so peak RSS barely shows the saving) or, with pinned thresholds, pays fresh page faults
// and zeroing for every multi-MiB allocation in the process, activations included. Buckets come in a few
// sizes, so a pool keyed by size holds exactly the peak number of buckets live at once (bounded by
// stage3_max_live_parameters + the prefetch) and reuses warm pages: no faults, no process-wide tuning.
//
// Buffers of 1 MiB and up are mapped from the kernel (mmap), not taken from malloc: malloc would raise glibc's
// dynamic mmap threshold when one is trimmed, so later mid-sized allocations of the whole process (activations)
// would come from its heap and stay resident when freed; a mapping is returned to the system by trim at once.
//
// The buffer is attached to the *existing* StorageImpl (not a new storage): autograd keeps views of the
// weights for backward, and they must see the re-gathered data (see sharded.py, [Note: storage swap]).
// Detaching installs an empty DataPtr; the previous DataPtr's deleter returns the buffer to the pool,
// whoever drops it (our detach, a storage resize_, or the storage's destruction).
#include <ATen/core/Tensor.h>
#include <c10/core/StorageImpl.h>
#include <torch/library.h>

#include <sys/mman.h>

#include <cstdlib>
#include <mutex>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace ds::memory {
namespace {

constexpr size_t kAlignment = 64;  // c10's CPU allocator alignment: vectorised kernels may rely on it
constexpr size_t kMapBytes = 1 << 20;  // from this size on a buffer is a mapping of its own (see the header)

void* allocate(size_t nbytes) {
  void* ptr = nullptr;
  if (nbytes >= kMapBytes) {
    ptr = mmap(nullptr, nbytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return ptr == MAP_FAILED ? nullptr : ptr;  // page-aligned, so kAlignment-aligned too
  }
  return posix_memalign(&ptr, kAlignment, nbytes) == 0 ? ptr : nullptr;
}

void deallocate(void* ptr, size_t nbytes) {
  if (nbytes >= kMapBytes) {
    munmap(ptr, nbytes);
  } else {
    std::free(ptr);
  }
}

class HostPool {
 public:
  // Leaked on purpose: storages may hand buffers back during interpreter shutdown.
  static HostPool& instance() {
    static auto* pool = new HostPool();
    return *pool;
  }

  void* acquire(size_t nbytes) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto& free_list = free_[nbytes];
      if (!free_list.empty()) {
        void* ptr = free_list.back();
        free_list.pop_back();
        cached_ -= nbytes;
        in_use_ += nbytes;
        return ptr;
      }
    }
    void* ptr = allocate(nbytes);
    TORCH_CHECK(ptr != nullptr,
                "ds_strategy host pool: out of memory allocating ", nbytes, " bytes for a gathered ZeRO-3 bucket");
    std::lock_guard<std::mutex> lock(mutex_);
    in_use_ += nbytes;
    return ptr;
  }

  void release(void* ptr, size_t nbytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    free_[nbytes].push_back(ptr);
    in_use_ -= nbytes;
    cached_ += nbytes;
  }

  // Give every cached (unused) buffer back to the system; buffers in use are unaffected.
  int64_t trim() {
    std::lock_guard<std::mutex> lock(mutex_);
    const int64_t freed = static_cast<int64_t>(cached_);
    for (auto& [nbytes, list] : free_) {
      for (void* ptr : list) deallocate(ptr, nbytes);
      list.clear();
    }
    free_.clear();
    cached_ = 0;
    return freed;
  }

  std::tuple<int64_t, int64_t> stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    return {static_cast<int64_t>(in_use_), static_cast<int64_t>(cached_)};
  }

 private:
  std::mutex mutex_;
  std::unordered_map<size_t, std::vector<void*>> free_;
  size_t in_use_ = 0;
  size_t cached_ = 0;
};

struct Lease {
  void* ptr;
  size_t nbytes;
};

void return_lease(void* ctx) {
  auto* lease = static_cast<Lease*>(ctx);
  HostPool::instance().release(lease->ptr, lease->nbytes);
  delete lease;
}

// Point `tensor`'s storage at a pooled buffer of `nbytes` (> 0), or at nothing (0). Contents of a newly
// attached buffer are undefined: the caller fills it (stage 3 all-gathers into it at once).
void host_pool_resize_(const at::Tensor& tensor, int64_t nbytes) {
  TORCH_CHECK(tensor.device().is_cpu(), "host_pool_resize_: the tensor is on ", tensor.device(),
              "; the host pool serves CPU storages");
  TORCH_CHECK(nbytes >= 0, "host_pool_resize_: nbytes must be >= 0, got ", nbytes);
  c10::StorageImpl* storage = tensor.storage().unsafeGetStorageImpl();
  if (nbytes == 0) {
    storage->set_data_ptr_noswap(c10::DataPtr(nullptr, c10::Device(c10::kCPU)));  // old deleter runs
    storage->set_nbytes(0);
    return;
  }
  TORCH_CHECK(storage->nbytes() == 0, "host_pool_resize_: the storage already holds ", storage->nbytes(),
              " bytes; resize it to 0 first");
  const auto size = static_cast<size_t>(nbytes);
  void* ptr = HostPool::instance().acquire(size);
  storage->set_data_ptr_noswap(c10::DataPtr(ptr, new Lease{ptr, size}, &return_lease, c10::Device(c10::kCPU)));
  storage->set_nbytes(size);
}

int64_t host_pool_trim() { return HostPool::instance().trim(); }

std::tuple<int64_t, int64_t> host_pool_stats() { return HostPool::instance().stats(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(ds_strategy, m) {
  m.def("host_pool_resize_(Tensor(a!) tensor, int nbytes) -> ()");
  m.def("host_pool_trim() -> int");
  m.def("host_pool_stats() -> (int in_use, int cached)");
  m.impl("host_pool_trim", &host_pool_trim);  // no tensor arguments: a catch-all kernel
  m.impl("host_pool_stats", &host_pool_stats);
}

TORCH_LIBRARY_IMPL(ds_strategy, CPU, m) { m.impl("host_pool_resize_", &host_pool_resize_); }

}  // namespace ds::memory
