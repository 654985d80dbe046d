// CPU used by idle UCX transports (was a timed unit test in
// tests/unit/kvtransfer/kvtransfer_test.cc; speed belongs here). Two
// transports with an imported peer and nothing to do: their progress
// threads should sleep on the worker's event fd instead of spinning. The
// physical limit to compare with: a spinning progress thread uses a whole
// core, 1.0 CPU-second per second (reported as cpu_per_wall_s).
#include <benchmark/benchmark.h>
#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <thread>

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

}  // namespace

BENCHMARK_MAIN();
