// What the bench commands read about processes from /proc: CPU time charged
// to a process and the machine's load average, recorded next to every
// number a benchmark prints.
#pragma once

#include <fmt/format.h>
#include <time.h>
#include <unistd.h>

#include <fstream>
#include <iterator>
#include <sstream>
#include <string>

namespace tandem::cli {

// utime + stime of `pid` in seconds (/proc/PID/stat, 10 ms ticks); < 0 when
// it cannot be read.
inline double ProcessCpuSecondsFromStat(int pid) {
  std::ifstream in(fmt::format("/proc/{}/stat", pid));
  std::string s((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t close = s.rfind(')');
  if (close == std::string::npos) return -1;
  std::istringstream f(s.substr(close + 2));
  std::string field;
  // Fields after comm start at 3 (state); utime is 14, stime 15.
  long long utime = 0, stime = 0;
  for (int i = 3; i <= 15 && f >> field; ++i) {
    if (i == 14) utime = std::stoll(field);
    if (i == 15) stime = std::stoll(field);
  }
  return double(utime + stime) / double(sysconf(_SC_CLK_TCK));
}

// CPU time charged to `pid` (every thread it has run, those that exited
// included), in seconds; < 0 when it cannot be read. Read from the
// process's CPU clock (clock_getcpuclockid: nanoseconds, the scheduler's
// own runtime sum) rather than utime + stime from /proc/PID/stat, which
// count in 10 ms ticks: a bench row of 200 prompts at ~1 ms each is only
// ~20 ticks, so a tick was 5 % of the number. /proc/PID/stat remains the
// fallback where the clock cannot be read.
inline double ProcessCpuSeconds(int pid) {
  clockid_t clock;
  timespec ts{};
  if (clock_getcpuclockid(pid, &clock) == 0 && clock_gettime(clock, &ts) == 0) {
    return double(ts.tv_sec) + double(ts.tv_nsec) * 1e-9;
  }
  return ProcessCpuSecondsFromStat(pid);
}

// The one-minute load average.
inline double LoadAverage1() {
  std::ifstream in("/proc/loadavg");
  double l = 0;
  in >> l;
  return l;
}

}  // namespace tandem::cli
