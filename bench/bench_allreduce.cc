// AllReduceSum on the shared-memory communicator (src/parallel/
// shm_communicator.h) between 2 rank processes, 1 KiB .. 4 MiB, next to
// memcpy of the same sizes in the same run (the physical yardstick).
//
// Rank 1 is a forked process that follows rank 0 (this process): before
// each benchmark run rank 0 broadcasts {bytes, iterations}, then both run
// that many all-reduces. bytes/s = payload bytes reduced per second (one
// rank's buffer). A 2-rank all-reduce moves about twice a memcpy's traffic
// per rank (copy in: read + write N; tree sum: read 2N, write N), so half
// the memcpy rate is the ceiling on a quiet machine.
//
//   build/bench/bench_allreduce [--benchmark_min_time=0.2]
#include <benchmark/benchmark.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "parallel/shm_communicator.h"

namespace {

using tandem::parallel::Communicator;
using tandem::parallel::CreateShmCommunicator;

Communicator* g_comm = nullptr;  // rank 0's

struct Command {
  uint64_t bytes = 0;  // 0: stop
  uint64_t iterations = 0;
};

Command Exchange(Communicator& comm, Command cmd) {
  std::byte* p = reinterpret_cast<std::byte*>(&cmd);
  if (!comm.Broadcast({p, sizeof(cmd)}, 0).ok()) return {};
  return cmd;
}

int FollowerMain(const std::string& group) {
  auto comm = CreateShmCommunicator(group, 1, 2, 30000);
  if (!comm.ok()) {
    std::fprintf(stderr, "rank 1: %s\n", comm.status().ToString().c_str());
    return 1;
  }
  std::vector<float> data;
  while (true) {
    const Command cmd = Exchange(**comm, {});
    if (cmd.bytes == 0) return 0;
    data.assign(cmd.bytes / sizeof(float), 1.0f);
    for (uint64_t i = 0; i < cmd.iterations; ++i) {
      if (!(*comm)->AllReduceSum(data).ok()) return 2;
    }
  }
}

void BM_ShmAllReduce2Ranks(benchmark::State& state) {
  const size_t bytes = static_cast<size_t>(state.range(0));
  std::vector<float> data(bytes / sizeof(float), 1.0f);
  Exchange(*g_comm, {bytes, static_cast<uint64_t>(state.max_iterations)});
  for (auto _ : state) {
    if (tandem::Status s = g_comm->AllReduceSum(data); !s.ok()) {
      state.SkipWithError(s.ToString().c_str());
      break;
    }
    benchmark::DoNotOptimize(data.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(bytes));
}

void BM_Memcpy(benchmark::State& state) {
  const size_t bytes = static_cast<size_t>(state.range(0));
  std::vector<char> src(bytes, 1), dst(bytes, 0);
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), bytes);
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(bytes));
}

}  // namespace

BENCHMARK(BM_ShmAllReduce2Ranks)->RangeMultiplier(4)->Range(1 << 10, 4 << 20)->UseRealTime();
BENCHMARK(BM_Memcpy)->RangeMultiplier(4)->Range(1 << 10, 4 << 20)->UseRealTime();

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  const std::string group = "bench-allreduce-" + std::to_string(getpid());
  const pid_t follower = fork();
  if (follower == 0) _exit(FollowerMain(group));
  int rc = 0;
  {
    auto comm = CreateShmCommunicator(group, 0, 2, 30000);
    if (!comm.ok()) {
      std::fprintf(stderr, "rank 0: %s\n", comm.status().ToString().c_str());
      rc = 1;
    } else {
      g_comm = comm->get();
      benchmark::RunSpecifiedBenchmarks();
      Exchange(*g_comm, {});  // stop the follower
      g_comm = nullptr;
    }
  }
  int status = 0;
  waitpid(follower, &status, 0);
  benchmark::Shutdown();
  return rc != 0 ? rc : (WIFEXITED(status) ? WEXITSTATUS(status) : 1);
}
