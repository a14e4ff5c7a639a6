// The CPU kernels' worker threads: one pool per process.
#pragma once

#include <ATen/Parallel.h>  // at::get_num_threads
#include <pthread.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <new>
#include <thread>
#include <vector>

namespace sgl_nb {

// A new id for each call of a kernel whose threads keep state across its chunks
// (thread_local, prepared on a thread's first chunk): a thread compares the id it saved
// with the running call's, and state from an earlier call is never taken for this one's.
inline uint64_t next_call_id() {
  static std::atomic<uint64_t> last{0};
  return last.fetch_add(1, std::memory_order_relaxed) + 1;
}

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

  // f(begin, end) over sub-ranges covering [0, n) once each, on up to `threads` threads
  // (the caller included). Each thread starts on its own contiguous part, in chunks of
  // about 1/16 of it, then takes chunks left in the others' parts; the caller never waits
  // for a worker that has not started: it closes the job once every chunk is taken and
  // waits only for the chunks in progress. (With a fixed part per thread, a worker the OS
  // had not scheduled yet held up each of a decode step's ~150 jobs: on a 2-core machine
  // at load average 8 the int4 step took 1.35x as long, median of 40, measured.) A second
  // caller while a job runs (another Python thread) does its whole loop itself. A chunk
  // holds at least `min_grain` items (one-row int4 matmuls streamed 5-8% slower in chunks
  // of 1/16 of a part: int4_row_panels).
  template <typename F>
  void parallel_for(int64_t n, const F& f, int64_t min_grain = 1) {
    const int64_t want = threads.load() > 0 ? threads.load() : at::get_num_threads();
    const int64_t threads = std::min<int64_t>({want, n, kMaxParts});
    if (threads <= 1 || running_.exchange(true, std::memory_order_acquire)) {
      if (n > 0) f(0, n);
      return;
    }
    ensure_workers(threads - 1);
    const Job job = [](const void* fn, int64_t b, int64_t e) { (*static_cast<const F*>(fn))(b, e); };
    job_ = job;
    job_fn_ = &f;
    nparts_ = threads;
    grain_ = std::max<int64_t>(min_grain, n / (threads * 16));
    for (int64_t p = 0; p < threads; ++p) {
      parts_[p].next.store(n * p / threads, std::memory_order_relaxed);
      parts_[p].end = n * (p + 1) / threads;
    }
    const uint64_t gen = generation_.load(std::memory_order_relaxed) + 1;
    state_.store(gate(gen) | kOpen, std::memory_order_release);
    publish(gen);
    work(0);
    uint64_t s = state_.load(std::memory_order_relaxed);
    while (!state_.compare_exchange_weak(s, s & ~kOpen, std::memory_order_acq_rel)) {
    }
    while (state_.load(std::memory_order_acquire) & kCount) cpu_relax();
    running_.store(false, std::memory_order_release);
  }

  // Stop and join every worker (at interpreter exit, before Python tears down): a process
  // then ends with no thread of ours left. Waits for a running job; a later job starts
  // new workers.
  void stop() {
    while (running_.exchange(true, std::memory_order_acquire)) std::this_thread::yield();
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
    running_.store(false, std::memory_order_release);
  }

 private:
  WorkerPool() {
    pthread_atfork(nullptr, nullptr, [] { WorkerPool::get().forget_parent_threads(); });
  }

  // In a forked child (a fork handler: the child has one thread). The parent's workers do
  // not exist here, and its flags, mutex and condition variable may hold their state: with a
  // parent's worker asleep at the fork, notify_all blocked forever in the child (seen).
  // Fresh ones, and no workers; the parent's thread handles are left, never joined nor
  // destroyed (destroying a joinable std::thread terminates the process).
  void forget_parent_threads() {
    running_.store(false, std::memory_order_relaxed);  // the job's caller is not here
    sleepers_.store(0, std::memory_order_relaxed);
    new (&sleep_mutex_) std::mutex;
    new (&sleep_cv_) std::condition_variable;
    new std::vector<std::thread>(std::move(threads_));
    threads_.clear();
    workers_ = 0;
  }

  // ~100 us of pause instructions: enough for the gaps inside a step; between steps (Python
  // work, a stream consumer on another thread) a spinning worker would take a core.
  static constexpr int kSpins = 4000;

  static void cpu_relax() {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }

  using Job = void (*)(const void*, int64_t, int64_t);
  static constexpr int64_t kMaxParts = 64;
  // state_: the low 32 bits of the job's generation, an open bit, and the count of workers
  // inside the job. A worker enters only an open job of the generation it was woken for,
  // so a late one never touches a job its caller has returned from.
  static constexpr uint64_t kOpen = uint64_t{1} << 31, kCount = kOpen - 1;
  static uint64_t gate(uint64_t gen) { return (gen & 0xFFFFFFFFu) << 32; }

  // Chunks of part p, then of every other part, until none is left.
  void work(int64_t p) {
    for (int64_t k = 0; k < nparts_; ++k) {
      Part& part = parts_[(p + k) % nparts_];
      for (;;) {
        const int64_t b = part.next.fetch_add(grain_, std::memory_order_relaxed);
        if (b >= part.end) break;
        job_(job_fn_, b, std::min(b + grain_, part.end));
      }
    }
  }

  // Moves the generation to `gen`, waking the workers asleep. The lock and the wake-up only
  // when one sleeps (a mutex and a broadcast per job were ~1.4% of a decode step's caller,
  // in perf): a worker counts itself in sleepers_ before it checks the generation under the
  // mutex, so either this load sees it (and the lock orders the wake-up after its wait
  // began) or its check sees `gen` (both seq_cst: one order for the store and the load).
  void publish(uint64_t gen) {
    generation_.store(gen, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) == 0) return;
    { std::lock_guard<std::mutex> lock(sleep_mutex_); }
    sleep_cv_.notify_all();
  }

  // Joins the job of generation `gen` if it is still open: true when it did.
  bool enter(uint64_t gen) {
    uint64_t s = state_.load(std::memory_order_acquire);
    while ((s & ~(kOpen | kCount)) == gate(gen) && (s & kOpen)) {
      if (state_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel)) return true;
    }
    return false;
  }

  void ensure_workers(int64_t count) {
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
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        {
          std::unique_lock<std::mutex> lock(sleep_mutex_);
          sleep_cv_.wait(lock, [&] { return generation_.load() != seen; });
        }
        sleepers_.fetch_sub(1, std::memory_order_relaxed);
      }
      if (stopping_.load(std::memory_order_acquire)) return;
      seen = now;
      if (enter(now)) {
        work(id % nparts_);
        state_.fetch_sub(1, std::memory_order_release);
      }
    }
  }

  std::vector<std::thread> threads_;
  std::atomic<bool> stopping_{false};  // set before the generation moves
  std::atomic<bool> running_{false};   // a job (or stop) holds the pool
  std::atomic<int64_t> sleepers_{0};   // workers in (or about to enter) sleep_cv_'s wait
  std::mutex sleep_mutex_;
  std::condition_variable sleep_cv_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<uint64_t> state_{0};
  struct alignas(64) Part {
    std::atomic<int64_t> next{0};
    int64_t end = 0;
  };
  Part parts_[kMaxParts];
  Job job_ = nullptr;
  const void* job_fn_ = nullptr;
  int64_t nparts_ = 1, grain_ = 1, workers_ = 0;
};

}  // namespace sgl_nb
