// A test must not leave processes behind, even when it dies (a crash, a
// SIGKILL from ctest's timeout, ^C): every process an integration test
// starts is registered with the test process's reaper, a small process
// forked once that holds the read end of a pipe whose only write end is in
// the test process. When the test process dies, for whatever reason, the
// kernel closes that write end; the reaper reads end-of-file and sends
// SIGKILL to every process (and process group) still registered, stopped
// ones included, then exits.
//
// Why not PR_SET_PDEATHSIG alone: it fires when the *thread* that forked
// the child exits (a fleet started from a helper thread would die early),
// it reaches only the direct child (`tandem launch`, not its proxy and
// workers), and the launcher passes SIGTERM on, which a SIGSTOPped worker
// never acts on.
//
// Processes are registered by pid; a process the test stops and reaps
// itself should be forgotten (Forget), so that a later reuse of its pid is
// never hit. Thread-safe.
#pragma once

#include <sys/types.h>

namespace tandem::testing {

// Kills `pid` and its process group (when it leads one) with SIGKILL if
// the test process dies before Forget(pid). Starts the reaper on first use.
void ReapOnExit(pid_t pid);
void Forget(pid_t pid);
// The reaper's pid (-1 before the first ReapOnExit), for tests of it.
pid_t ReaperPid();

}  // namespace tandem::testing
