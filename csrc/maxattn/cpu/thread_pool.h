// The CPU backend's shared thread pool.
//
// One process-wide pool, created on first use, with hardware_concurrency - 1
// worker threads: the thread that calls ParallelFor works too, so a call uses
// every core. Several threads may call ParallelFor at once (each call is its
// own job, workers help whichever job is queued first). A ParallelFor issued
// from inside a task runs inline, so nested use never deadlocks.
#ifndef MAXATTN_CPU_THREAD_POOL_H_
#define MAXATTN_CPU_THREAD_POOL_H_

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace maxattn::cpu {

class ThreadPool {
 public:
  // fn(task, slot): task in [0, n); slot in [0, MaxSlots()) identifies the
  // participating thread within this one call (stable for the thread while
  // the call lasts), for per-thread scratch without locks.
  using TaskFn = std::function<void(int64_t task, int slot)>;

  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // The lazily created shared pool (size = hardware_concurrency).
  static ThreadPool& Shared();

  // Runs fn for every task in [0, n) and returns when all are done. The first
  // exception thrown by a task is rethrown here (after all tasks finished).
  void ParallelFor(int64_t n, const TaskFn& fn);

  // Upper bound on the slot numbers handed to tasks by one ParallelFor.
  int MaxSlots() const { return static_cast<int>(workers_.size()) + 1; }

 private:
  struct Job;
  void WorkerLoop();
  static void Participate(Job& job);

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Job>> queue_;  // guarded by mu_
  bool stop_ = false;                       // guarded by mu_
  std::vector<std::thread> workers_;
};

// Shorthand for ThreadPool::Shared().ParallelFor(n, fn).
void ParallelFor(int64_t n, const ThreadPool::TaskFn& fn);
int MaxParallelSlots();

}  // namespace maxattn::cpu

#endif  // MAXATTN_CPU_THREAD_POOL_H_
