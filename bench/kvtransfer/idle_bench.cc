// CPU used by idle and sparsely writing UCX transports (was a timed unit
// test in tests/unit/kvtransfer/kvtransfer_test.cc; speed belongs here). Two
// transports with an imported peer and nothing to do: their progress
// threads should sleep on the worker's event fd instead of spinning. The
// physical limit to compare with: a spinning progress thread uses a whole
// core, 1.0 CPU-second per second (reported as cpu_per_wall_s).
#include <benchmark/benchmark.h>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <thread>
#include <vector>

#include "kvtransfer/transport.h"

namespace {

double ProcessCpuSeconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         1e-6 * static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

std::unique_ptr<tandem::kvtransfer::Transport> Make(const char* name) {
  tandem::kvtransfer::TransportOptions o;
  o.backend = "ucx";
  o.agent_name = name;
  o.block_bytes = 4096;
  o.num_blocks = 2;
  auto t = tandem::kvtransfer::CreateTransport(o);
  if (!t.ok()) {
    std::fprintf(stderr, "%s\n", t.status().ToString().c_str());
    return nullptr;
  }
  return std::move(t).value();
}

void BM_IdleUcxTransports(benchmark::State& state) {
  auto a = Make("idle-a");
  auto b = Make("idle-b");
  if (!a || !b) {
    state.SkipWithError("cannot create UCX transports");
    return;
  }
  auto peer = a->ImportPeer(b->LocalDescriptor());
  if (!peer.ok()) {
    state.SkipWithError("cannot import the peer");
    return;
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // connection set-up
  double cpu = 0, wall = 0;
  for (auto _ : state) {
    const double c0 = ProcessCpuSeconds();
    const auto t0 = std::chrono::steady_clock::now();
    std::this_thread::sleep_for(std::chrono::milliseconds(400));
    wall += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    cpu += ProcessCpuSeconds() - c0;
  }
  state.counters["cpu_per_wall_s"] = cpu / wall;
  (void)a->ReleasePeer(*peer);
}
BENCHMARK(BM_IdleUcxTransports)->Iterations(5)->Unit(benchmark::kMillisecond);

// A writer posting one 4 KiB block with a notice every `gap` microseconds,
// as a prefiller pushes each prefill chunk's blocks (issue 23): the CPU both
// progress threads use per write, against the time between writes (a
// thread polling through the gap would use all of it), and the latency from
// Post to the notice's callback on the receiver.
void BM_SparseUcxWrites(benchmark::State& state) {
  const auto gap = std::chrono::microseconds(state.range(0));
  auto a = Make("sparse-a");
  auto b = Make("sparse-b");
  if (!a || !b) {
    state.SkipWithError("cannot create UCX transports");
    return;
  }
  // Both callbacks run on progress threads; the bench thread waits on `cv`.
  std::mutex mu;
  std::condition_variable cv;
  int received = 0, completed = 0;
  std::chrono::steady_clock::time_point received_at;
  b->SetNotificationCallback([&](tandem::kvtransfer::Notification) {
    std::lock_guard lock(mu);
    ++received;
    received_at = std::chrono::steady_clock::now();
    cv.notify_all();
  });
  auto peer = a->ImportPeer(b->LocalDescriptor());
  if (!peer.ok()) {
    state.SkipWithError("cannot import the peer");
    return;
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // connection set-up
  const std::vector<tandem::kvtransfer::BlockPair> pairs = {{0, 0}};
  std::vector<double> latency_us;
  double cpu = 0;
  int64_t writes = 0;
  for (auto _ : state) {
    const double c0 = ProcessCpuSeconds();
    for (int i = 0; i < 200; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      auto x = a->PrepareBlockWrite(*peer, pairs, "n");
      const bool posted =
          x.ok() && a->Post(*x, [&](tandem::kvtransfer::XferId, tandem::kvtransfer::XferStatus,
                                    const tandem::Status&) {
                       std::lock_guard lock(mu);
                       ++completed;
                       cv.notify_all();
                     }).ok();
      if (!posted) {
        state.SkipWithError("write refused");
        return;
      }
      {
        std::unique_lock lock(mu);
        if (!cv.wait_for(lock, std::chrono::seconds(5),
                         [&] { return received == writes + 1 && completed == writes + 1; })) {
          state.SkipWithError("no notice or completion within 5 s");
          return;
        }
        latency_us.push_back(std::chrono::duration<double, std::micro>(received_at - t0).count());
      }
      (void)a->Release(*x);
      std::this_thread::sleep_until(t0 + gap);
      ++writes;
    }
    cpu += ProcessCpuSeconds() - c0;
  }
  std::sort(latency_us.begin(), latency_us.end());
  state.counters["cpu_us_per_write"] = 1e6 * cpu / static_cast<double>(writes);
  state.counters["gap_us"] = static_cast<double>(gap.count());
  state.counters["notice_p50_us"] = latency_us[latency_us.size() / 2];
  state.counters["notice_p99_us"] = latency_us[latency_us.size() * 99 / 100];
  const auto sa = a->stats(), sb = b->stats();
  state.counters["writer_polls_per_write"] =
      static_cast<double>(sa.progress_idle_polls) / static_cast<double>(writes);
  state.counters["receiver_polls_per_write"] =
      static_cast<double>(sb.progress_idle_polls) / static_cast<double>(writes);
  state.counters["writer_sleeps_per_write"] =
      static_cast<double>(sa.progress_sleeps) / static_cast<double>(writes);
  state.counters["receiver_sleeps_per_write"] =
      static_cast<double>(sb.progress_sleeps) / static_cast<double>(writes);
  (void)a->ReleasePeer(*peer);
}
BENCHMARK(BM_SparseUcxWrites)
    ->Arg(5000)
    ->Arg(1000)
    ->Arg(100)
    ->Iterations(3)
    ->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
