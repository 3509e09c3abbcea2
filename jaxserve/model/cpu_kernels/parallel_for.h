// Work sharing for our CPU kernels: `n` tasks handed out through an atomic counter to the
// calling thread and XLA's intra-op pool.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace jaxserve {

constexpr int64_t kSpinsBeforeYield = 4096;  // ~50-150 us of pause instructions

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::this_thread::yield();
#endif
}

// Runs f(0) ... f(n - 1) on the caller and the pool; returns when all have finished. The
// caller is one of the pool's threads, so it asks for num_threads() - 1 helpers (one per other
// core, not one more thread than cores), and it spins for the tasks helpers still hold rather
// than sleeping on a condition variable: a wake-up costs tens of microseconds, and a step
// calls this once per projection and layer (~200 times for a 30-layer model). The wait never
// depends on a task nobody runs: a helper takes a task only once it is running, and the caller
// itself works through every task left.
template <typename F>
void ParallelFor(xla::ffi::ThreadPool* pool, int64_t n, F&& f) {
  struct State {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto st = std::make_shared<State>();
  auto work = [st, n, &f] {
    int64_t i, finished = 0;
    while ((i = st->next.fetch_add(1)) < n) {
      f(i);
      ++finished;
    }
    if (finished) st->done.fetch_add(finished, std::memory_order_release);
  };
  const int64_t helpers =
      pool ? std::min<int64_t>(std::max<int64_t>(pool->num_threads() - 1, 0), n - 1) : 0;
  // A helper that starts after the work is done finds nothing to do and touches only `st`;
  // `f` is referenced only while tasks remain, i.e. before this function returns.
  for (int64_t h = 0; h < helpers; ++h) pool->Schedule([work] { work(); });
  work();
  // Spin briefly (the last items finish within microseconds of each other), then yield: on a
  // box with more runnable threads than cores, a helper holding an item may need this core.
  for (int64_t spins = 0; st->done.load(std::memory_order_acquire) != n; ++spins) {
    if (spins < kSpinsBeforeYield) {
      CpuRelax();
    } else {
      std::this_thread::yield();
    }
  }
}

}  // namespace jaxserve
