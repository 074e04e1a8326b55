#include "maxattn/cpu/thread_pool.h"

#include <algorithm>
#include <atomic>
#include <exception>

namespace maxattn::cpu {
namespace {
// True while this thread runs a task; a nested ParallelFor then runs inline
// (the outer call already occupies every core, and waiting for other workers
// from inside a task could deadlock).
thread_local bool t_inside_task = false;

struct InsideTaskScope {
  bool saved = t_inside_task;
  InsideTaskScope() { t_inside_task = true; }
  ~InsideTaskScope() { t_inside_task = saved; }
};
}  // namespace

struct ThreadPool::Job {
  Job(int64_t n_tasks, const TaskFn& f) : n(n_tasks), fn(f) {}
  const int64_t n;
  const TaskFn& fn;  // lives in the caller's frame, which waits for `done`.
  std::atomic<int64_t> next{0};
  std::atomic<int> slots{0};
  std::mutex mu;
  std::condition_variable cv;
  int64_t done = 0;            // guarded by mu
  std::exception_ptr error;    // guarded by mu
};

ThreadPool::ThreadPool(int num_threads) {
  workers_.reserve(static_cast<size_t>(std::max(0, num_threads - 1)));
  for (int i = 0; i + 1 < num_threads; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : workers_) t.join();
}

ThreadPool& ThreadPool::Shared() {
  // Magic static: thread-safe lazy construction; destroyed at exit.
  static ThreadPool pool(static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  return pool;
}

void ThreadPool::Participate(Job& job) {
  const int slot = job.slots.fetch_add(1);
  InsideTaskScope scope;
  int64_t finished = 0;
  std::exception_ptr error;
  for (int64_t i; (i = job.next.fetch_add(1)) < job.n;) {
    if (!error) {
      try {
        job.fn(i, slot);
      } catch (...) {
        error = std::current_exception();
      }
    }
    ++finished;  // a failed task still counts, so the caller never hangs.
  }
  if (finished == 0) return;
  std::lock_guard<std::mutex> lock(job.mu);
  if (error && !job.error) job.error = error;
  job.done += finished;
  if (job.done == job.n) job.cv.notify_all();
}

void ThreadPool::WorkerLoop() {
  for (;;) {
    std::shared_ptr<Job> job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
      if (stop_) return;
      job = queue_.front();
      // Every task of the front job is claimed: retire it from the queue.
      if (job->next.load() >= job->n) {
        queue_.pop_front();
        continue;
      }
    }
    Participate(*job);
  }
}

void ThreadPool::ParallelFor(int64_t n, const TaskFn& fn) {
  if (n <= 0) return;
  if (n == 1 || workers_.empty() || t_inside_task) {
    InsideTaskScope scope;
    for (int64_t i = 0; i < n; ++i) fn(i, 0);
    return;
  }
  auto job = std::make_shared<Job>(n, fn);
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(job);
  }
  if (n - 1 >= static_cast<int64_t>(workers_.size())) {
    cv_.notify_all();
  } else {
    for (int64_t i = 0; i < n - 1; ++i) cv_.notify_one();
  }
  Participate(*job);
  {
    std::unique_lock<std::mutex> lock(job->mu);
    job->cv.wait(lock, [&] { return job->done == job->n; });
  }
  {
    // Workers may not have retired it yet; `fn` dies with this frame.
    std::lock_guard<std::mutex> lock(mu_);
    auto it = std::find(queue_.begin(), queue_.end(), job);
    if (it != queue_.end()) queue_.erase(it);
  }
  if (job->error) std::rethrow_exception(job->error);
}

void ParallelFor(int64_t n, const ThreadPool::TaskFn& fn) { ThreadPool::Shared().ParallelFor(n, fn); }
int MaxParallelSlots() { return ThreadPool::Shared().MaxSlots(); }

}  // namespace maxattn::cpu
