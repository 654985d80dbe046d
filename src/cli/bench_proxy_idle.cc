// The `idle` workload of `tandem bench proxy` (bench_proxy_idle.h).
//
// CPU comes from /proc/PID/task/TID/schedstat (nanoseconds each thread ran)
// rather than utime + stime (10 ms ticks: an idle process spends a few ms
// per second, under one tick per measurement), wake-ups from
// voluntary_ctxt_switches in /proc/PID/task/TID/status: each is a thread
// going to sleep, i.e. one wake-up later. Threads that start and end within
// the window are not counted (an idle fleet starts none).
#include "cli/bench_proxy_idle.h"

#include <fmt/format.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <thread>

#include "cli/proc_stats.h"

namespace tandem::cli {
namespace {

struct TaskSample {
  uint64_t run_ns = 0;
  uint64_t vcsw = 0;
};

// Every thread of `pid`: tid -> (run time, voluntary switches).
Result<std::map<int, TaskSample>> SampleTasks(int pid) {
  namespace fs = std::filesystem;
  std::map<int, TaskSample> out;
  std::error_code ec;
  const fs::path dir = fmt::format("/proc/{}/task", pid);
  fs::directory_iterator it(dir, ec);
  if (ec) return NotFoundError(fmt::format("process {} is gone ({})", pid, ec.message()));
  for (const auto& e : it) {
    const int tid = std::atoi(e.path().filename().c_str());
    TaskSample s;
    std::ifstream sched(e.path() / "schedstat");
    if (!(sched >> s.run_ns)) continue;  // the thread ended meanwhile
    std::ifstream status(e.path() / "status");
    for (std::string line; std::getline(status, line);) {
      if (line.rfind("voluntary_ctxt_switches:", 0) == 0) {
        s.vcsw = std::strtoull(line.c_str() + line.find(':') + 1, nullptr, 10);
      }
    }
    out[tid] = s;
  }
  return out;
}

}  // namespace

Result<std::vector<IdleRow>> MeasureIdle(const std::vector<IdleProc>& procs, double settle_s,
                                         double seconds) {
  if (!(seconds > 0) || seconds > 3600) {
    return InvalidArgumentError(
        fmt::format("--idle-seconds must be in (0, 3600], got {}", seconds));
  }
  std::this_thread::sleep_for(std::chrono::duration<double>(settle_s));
  std::vector<std::map<int, TaskSample>> before;
  for (const auto& p : procs) {
    TANDEM_ASSIGN_OR_RETURN(auto s, SampleTasks(p.pid));
    before.push_back(std::move(s));
  }
  const auto t0 = std::chrono::steady_clock::now();
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  std::vector<IdleRow> rows;
  for (size_t i = 0; i < procs.size(); ++i) {
    TANDEM_ASSIGN_OR_RETURN(auto after, SampleTasks(procs[i].pid));
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    IdleRow r;
    r.role = procs[i].role;
    r.pid = procs[i].pid;
    r.threads = static_cast<int>(after.size());
    uint64_t ns = 0, vcsw = 0;
    for (const auto& [tid, s] : after) {
      auto b = before[i].find(tid);
      const TaskSample base = b == before[i].end() ? TaskSample{} : b->second;
      ns += s.run_ns - std::min(s.run_ns, base.run_ns);
      vcsw += s.vcsw - std::min(s.vcsw, base.vcsw);
    }
    r.cpu_ms_per_s = double(ns) / 1e6 / dt;
    r.vcsw_per_s = double(vcsw) / dt;
    rows.push_back(r);
  }
  return rows;
}

int RunIdleWorkload(const std::vector<IdleProc>& procs, double seconds, nlohmann::json& out) {
  const double load_before = LoadAverage1();
  auto rows = MeasureIdle(procs, /*settle_s=*/1.0, seconds);
  if (!rows.ok()) {
    std::cerr << "tandem bench proxy: idle: " << rows.status().message() << "\n";
    return 1;
  }
  const double load1 = (load_before + LoadAverage1()) / 2;
  nlohmann::json procs_json = nlohmann::json::array();
  for (const auto& r : *rows) {
    std::cout << fmt::format("{:<7} {:<8} pid {:<8} threads {:>3}  CPU {:>7.3f} ms/s  wake-ups "
                             "{:>7.1f} /s  load1 {:.1f}\n",
                             "idle", r.role, r.pid, r.threads, r.cpu_ms_per_s, r.vcsw_per_s,
                             load1);
    procs_json.push_back({{"role", r.role},
                          {"pid", r.pid},
                          {"threads", r.threads},
                          {"cpu_ms_per_s", r.cpu_ms_per_s},
                          {"voluntary_switches_per_s", r.vcsw_per_s}});
  }
  std::cout.flush();
  out.push_back({{"workload", "idle"},
                 {"seconds", seconds},
                 {"processes", procs_json},
                 {"load1", load1}});
  return 0;
}

}  // namespace tandem::cli
