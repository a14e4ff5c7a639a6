// The CPU kernels' worker threads: one pool per process.
#pragma once

#include <ATen/Parallel.h>  // at::get_num_threads
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace sgl_nb {

// Our own workers rather than OpenMP: libgomp counts every thread team in the process, and
// once the caller's main thread has run an OpenMP region (any torch op in a notebook) there
// are more of its threads than cores, so it stops spinning between regions and each of the
// ~150 regions of a decode step pays a futex wake-up: int4 decode went from 9.6 to 31 ms
// per step (measured). These workers spin about 100 us between jobs, then sleep.
class WorkerPool {
 public:
  static WorkerPool& get() {
    // Never destroyed: at exit its condition variable may still have sleeping workers, and
    // destroying it then blocks forever (seen).
    static WorkerPool* pool = new WorkerPool;
    return *pool;
  }

  // Threads per job (the caller included); 0: torch's intra-op setting.
  std::atomic<int64_t> threads{0};

  // f(begin, end) over [0, n), one contiguous part per thread (the caller runs part 0). A
  // second caller while a job runs (another Python thread) does its whole loop itself.
  void parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& f) {
    const int64_t want = threads.load() > 0 ? threads.load() : at::get_num_threads();
    const int64_t threads = std::min<int64_t>(want, n);
    std::unique_lock<std::mutex> busy(run_mutex_, std::try_to_lock);
    if (threads <= 1 || !busy.owns_lock()) {
      if (n > 0) f(0, n);
      return;
    }
    ensure_workers(threads - 1);
    job_ = &f;
    n_ = n;
    parts_ = threads;
    pending_.store(threads - 1, std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> lock(sleep_mutex_);
      generation_.fetch_add(1, std::memory_order_release);
    }
    sleep_cv_.notify_all();
    run_part(0);
    while (pending_.load(std::memory_order_acquire) > 0) cpu_relax();
  }

  // Stop and join every worker (at interpreter exit, before Python tears down): a process
  // then ends with no thread of ours left. Waits for a running job; a later job starts
  // new workers.
  void stop() {
    std::lock_guard<std::mutex> busy(run_mutex_);
    if (pid_ != getpid()) return;  // a forked child: its parent's threads are not here
    {
      std::lock_guard<std::mutex> lock(sleep_mutex_);
      stopping_.store(true, std::memory_order_release);
      generation_.fetch_add(1, std::memory_order_release);
    }
    sleep_cv_.notify_all();
    for (auto& t : threads_) t.join();
    threads_.clear();
    workers_ = 0;
    stopping_.store(false, std::memory_order_release);
  }

 private:
  // ~100 us of pause instructions: enough for the gaps inside a step; between steps (Python
  // work, a stream consumer on another thread) a spinning worker would take a core.
  static constexpr int kSpins = 4000;

  static void cpu_relax() {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }

  void run_part(int64_t p) {
    const int64_t begin = n_ * p / parts_, end = n_ * (p + 1) / parts_;
    if (begin < end) (*job_)(begin, end);
  }

  void ensure_workers(int64_t count) {
    if (pid_ != getpid()) {  // a forked child has none of its parent's threads
      pid_ = getpid();
      workers_ = 0;
      // Its parent's threads do not exist here: their handles are left, never joined nor
      // destroyed (destroying a joinable std::thread terminates the process).
      new std::vector<std::thread>(std::move(threads_));
      threads_.clear();
    }
    for (; workers_ < count; ++workers_) {
      // `seen` is read here, before the job that needs the worker is published, not when
      // the thread gets to run.
      const uint64_t seen = generation_.load(std::memory_order_acquire);
      threads_.emplace_back([this, id = workers_ + 1, seen] { loop(id, seen); });
    }
  }

  void loop(int64_t id, uint64_t seen) {
    for (;;) {
      uint64_t now;
      int spins = 0;
      while ((now = generation_.load(std::memory_order_acquire)) == seen) {
        if (++spins < kSpins) {
          cpu_relax();
          continue;
        }
        std::unique_lock<std::mutex> lock(sleep_mutex_);
        sleep_cv_.wait(lock, [&] { return generation_.load() != seen; });
      }
      if (stopping_.load(std::memory_order_acquire)) return;
      seen = now;
      if (id < parts_) {
        run_part(id);
        pending_.fetch_sub(1, std::memory_order_acq_rel);
      }
    }
  }

  std::vector<std::thread> threads_;
  std::atomic<bool> stopping_{false};  // set before the generation moves
  std::mutex run_mutex_, sleep_mutex_;
  std::condition_variable sleep_cv_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int64_t> pending_{0};
  const std::function<void(int64_t, int64_t)>* job_ = nullptr;
  int64_t n_ = 0, parts_ = 1, workers_ = 0;
  pid_t pid_ = getpid();
};

}  // namespace sgl_nb
