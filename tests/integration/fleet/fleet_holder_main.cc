// Helper for reaper_test: starts a 1P1D fleet through the harness (so the
// fleet is registered with this process's reaper), SIGSTOPs its decoder (a
// stopped process ignores SIGTERM: only SIGKILL ends it), writes one line
// "launcher proxy worker... reaper" (pids) to stdout, then waits to be
// killed. It never stops its fleet itself: that is the reaper's job once
// this process is gone.
#include <signal.h>
#include <unistd.h>

#include <cstdio>

#include "fleet_harness.h"
#include "reaper.h"

int main() {
  tandem::testing::FleetOptions o;
  o.num_blocks = 64;
  auto fleet = tandem::testing::Fleet::Launch(o);
  if (!fleet.ok()) {
    std::fprintf(stderr, "%s\n", fleet.status().ToString().c_str());
    return 1;
  }
  std::printf("%d %d", (*fleet)->launcher_pid(), (*fleet)->proxy_pid());
  for (const auto& w : (*fleet)->workers()) {
    if (w.role == "decode") kill(w.pid, SIGSTOP);
    std::printf(" %d", w.pid);
  }
  std::printf(" %d\n", tandem::testing::ReaperPid());
  std::fflush(stdout);
  for (;;) pause();  // killed by the test
}
