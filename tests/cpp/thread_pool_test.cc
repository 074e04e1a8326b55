#include "maxattn/cpu/thread_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <stdexcept>
#include <thread>
#include <vector>

namespace maxattn::cpu {
namespace {

TEST(ThreadPool, RunsEveryTaskOnce) {
  for (int64_t n : {0, 1, 2, 7, 1000}) {
    std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
    std::atomic<int> bad_slot{0};
    ParallelFor(n, [&](int64_t i, int slot) {
      hits[static_cast<size_t>(i)]++;
      if (slot < 0 || slot >= MaxParallelSlots()) bad_slot++;
    });
    for (auto& h : hits) EXPECT_EQ(h.load(), 1);
    EXPECT_EQ(bad_slot.load(), 0);
  }
}

TEST(ThreadPool, NestedCallsRunInline) {
  std::atomic<int64_t> sum{0};
  ParallelFor(8, [&](int64_t i, int) {
    ParallelFor(100, [&](int64_t j, int) { sum += i * 100 + j; });
  });
  EXPECT_EQ(sum.load(), 799 * 800 / 2);
}

TEST(ThreadPool, ConcurrentCallers) {
  std::vector<std::thread> threads;
  std::atomic<int64_t> total{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int rep = 0; rep < 50; ++rep) ParallelFor(64, [&](int64_t, int) { total++; });
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(total.load(), 4 * 50 * 64);
}

TEST(ThreadPool, ExceptionPropagatesAfterAllTasks) {
  std::atomic<int> ran{0};
  EXPECT_THROW(ParallelFor(50,
                           [&](int64_t i, int) {
                             ran++;
                             if (i == 3) throw std::runtime_error("boom");
                           }),
               std::runtime_error);
  EXPECT_GE(ran.load(), 1);
  // The pool is still usable.
  std::atomic<int> after{0};
  ParallelFor(10, [&](int64_t, int) { after++; });
  EXPECT_EQ(after.load(), 10);
}

TEST(ThreadPool, PrivatePool) {
  ThreadPool pool(3);
  std::atomic<int> n{0};
  pool.ParallelFor(100, [&](int64_t, int slot) {
    EXPECT_LT(slot, 3);
    n++;
  });
  EXPECT_EQ(n.load(), 100);
}

}  // namespace
}  // namespace maxattn::cpu
