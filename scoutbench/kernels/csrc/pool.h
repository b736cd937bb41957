// The library's thread pool: every kernel splits its work into tasks that run on it.
#pragma once

#include <pthread.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <new>
#include <thread>

#include "common.h"

#pragma GCC visibility push(hidden)
namespace sb {

// Concurrent callers share one set of helper threads. A call publishes its items as a job, runs them itself, and
// while its last items finish on other threads it takes items of the other published jobs instead of spinning.
// Helpers take items of any published job, but only while fewer callers than the call's thread count are inside
// the pool: on 2 cores ScoutAttention's main thread and its worker then each keep a core and the helper waits,
// where a third runnable thread would make every call's last item wait for a time slice.
class Pool {
 public:
  template <typename Fn>
  void run(int64_t n_tasks, int threads, Fn&& fn) {
    if (threads <= 1 || n_tasks <= 1) {
      for (int64_t i = 0; i < n_tasks; ++i) fn(i);
      return;
    }
    Job job;
    job.task = [](void* ctx, int64_t i) { (*static_cast<Fn*>(ctx))(i); };
    job.ctx = &fn;
    job.n_tasks = n_tasks;
    job.threads = threads;
    callers_.fetch_add(1);
    Slot* slot = publish(&job);
    if (slot == nullptr) {  // kSlots calls already inside: this one runs alone
      callers_.fetch_sub(1);
      for (int64_t i = 0; i < n_tasks; ++i) fn(i);
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      ensure_workers(threads - 1);
      generation_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
    while (take_item(job)) {
    }
    for (int spins = 0; job.done.load(std::memory_order_acquire) < n_tasks; ++spins) {
      if (help(&job, -1)) {
        spins = 0;
      } else if (spins < 4096) {
        _mm_pause_portable();
      } else {
        std::this_thread::yield();
      }
    }
    callers_.fetch_sub(1);
    slot->job.store(nullptr);
    while (slot->users.load() != 0) _mm_pause_portable();  // a helper that read the pointer lets go of it
  }

  // How long a helper stays awake after a job: SCOUTBENCH_KERNEL_SPIN_US (microseconds, 0: sleep at once), read
  // once; 1000 by default. benchmarks/ab_kernel_builds.py sets 0 to time single calls of two builds in one process,
  // where each build's awake helper would take a core from the other's calls.
  static int spin_us() {
    static const int value = [] {
      const char* text = std::getenv("SCOUTBENCH_KERNEL_SPIN_US");
      return text != nullptr && *text != '\0' ? std::max(0, std::atoi(text)) : 1000;
    }();
    return value;
  }

  void reset_after_fork() {
    // the child has none of the parent's threads: forget them (their objects are leaked, not joined)
    new (&mu_) std::mutex();
    new (&cv_) std::condition_variable();
    for (Slot& s : slots_) {
      s.job.store(nullptr);
      s.users.store(0);
    }
    callers_.store(0);
    workers_started_ = 0;
    generation_.store(0);
  }

 private:
  struct Job {
    void (*task)(void*, int64_t) = nullptr;
    void* ctx = nullptr;
    int64_t n_tasks = 0;
    int threads = 1;
    std::atomic<int64_t> next{0}, done{0};
  };
  // a published job; `users` counts the threads that may still read `job`, so its caller returns only after them
  struct Slot {
    std::atomic<Job*> job{nullptr};
    std::atomic<int> users{0};
  };
  static constexpr int kSlots = 4;

  static void _mm_pause_portable() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }

  Slot* publish(Job* job) {
    for (Slot& s : slots_) {
      Job* expected = nullptr;
      if (s.job.compare_exchange_strong(expected, job)) return &s;
    }
    return nullptr;
  }

  static bool take_item(Job& job) {
    const int64_t i = job.next.fetch_add(1, std::memory_order_acq_rel);
    if (i >= job.n_tasks) return false;
    job.task(job.ctx, i);
    job.done.fetch_add(1, std::memory_order_acq_rel);
    return true;
  }

  // one item of a published job other than `own`; a helper (`helper` >= 0) only of a job whose thread count
  // leaves it room beside the callers inside the pool. Whether it ran one.
  bool help(const Job* own, int helper) {
    for (Slot& s : slots_) {
      s.users.fetch_add(1);
      Job* job = s.job.load();
      const bool ran = job != nullptr && job != own && (helper < 0 || helper + callers_.load() < job->threads) &&
                       take_item(*job);
      s.users.fetch_sub(1);
      if (ran) return true;
    }
    return false;
  }

  void ensure_workers(int n) {  // under mu_
    while (workers_started_ < n) {
      const int index = workers_started_++;
      std::thread([this, index] { loop(index); }).detach();
    }
  }

  void loop(int index) {
    uint64_t seen = 0;
    for (;;) {
      if (!spin_for_job(seen)) {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
      }
      seen = generation_.load(std::memory_order_acquire);
      while (help(nullptr, index)) {
      }
    }
  }

  // Whether a job was published within spin_us() of the helper's last one. A helper asleep on the condition
  // variable takes tens of microseconds to wake on a VM, so a call of a few hundred microseconds would run mostly on
  // its caller (docs/platform.md); a decode step's calls come tens to hundreds of microseconds apart, and
  // ScoutAttention's CPU part once per layer. The helper yields between checks, so any other runnable thread (the
  // worker's Python, an OpenMP team) takes the core before it.
  bool spin_for_job(uint64_t seen) const {
    const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us());
    for (int i = 0;; ++i) {
      if (generation_.load(std::memory_order_acquire) != seen) return true;
      std::this_thread::yield();
      if ((i & 15) == 15 && std::chrono::steady_clock::now() >= until) return false;
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  Slot slots_[kSlots];
  std::atomic<int> callers_{0};
  int workers_started_ = 0;
  std::atomic<uint64_t> generation_{0};
};

// The one pool of the library (library.cpp): created on first use, never destroyed, reset in a forked child.
Pool& pool();

}  // namespace sb
#pragma GCC visibility pop
