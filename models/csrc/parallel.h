// parallel_chunks: at::parallel_for's split, with the idle threads taking over
// the chunks a slower thread has not started.
//
// at::parallel_for gives each thread a fixed share and waits for the last one.
// On a shared machine the cores do not run at one speed: here one vCPU ran a
// plain loop 1.4-1.5x slower than the other for minutes at a time (its host
// core busy with someone else's work), so every static split waited ~35% of
// its time for it. Each thread here still starts on its own contiguous share,
// front to back (the same memory locality as the static split), claiming
// `grain` items at a time from an atomic counter; once its share is done it
// claims what is left of the other shares, the same way.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <memory>

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace kvserve {

// f(begin, end) over [0, n) in chunks of `grain` items, on torch's threads
// (one call f(0, n) when one thread would do). f must not depend on which
// thread runs a chunk or in which order.
template <typename F>
void parallel_chunks(int64_t n, int64_t grain, const F& f) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  at::internal::lazy_init_num_threads();
  const int64_t chunks = (n + grain - 1) / grain;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), chunks);
#if defined(_OPENMP)
  if (threads > 1 && !omp_in_parallel()) {
    // One cache line per counter: the two threads bump their own counters
    // without bouncing a shared line.
    struct alignas(64) Share {
      std::atomic<int64_t> next;
      int64_t end;
    };
    std::unique_ptr<Share[]> shares(new Share[threads]);
    for (int64_t t = 0; t < threads; ++t) {
      shares[t].next.store(chunks * t / threads, std::memory_order_relaxed);
      shares[t].end = chunks * (t + 1) / threads;
    }
    std::exception_ptr error;
    std::atomic<bool> failed{false};
#pragma omp parallel num_threads(static_cast<int>(threads))
    {
      // The runtime may start fewer threads than asked: every thread walks
      // every share, so a share without its thread is still done.
      const int64_t me = omp_get_thread_num();
      for (int64_t k = 0; k < threads && !failed.load(std::memory_order_relaxed); ++k) {
        Share& s = shares[(me + k) % threads];
        for (int64_t c; (c = s.next.fetch_add(1, std::memory_order_relaxed)) < s.end;) {
          try {
            f(c * grain, std::min(n, (c + 1) * grain));
          } catch (...) {
#pragma omp critical(kvserve_parallel_chunks_error)
            if (!error) error = std::current_exception();
            failed.store(true, std::memory_order_relaxed);
            break;
          }
        }
      }
    }
    if (error) std::rethrow_exception(error);
    return;
  }
#endif
  f(0, n);
}

}  // namespace kvserve
