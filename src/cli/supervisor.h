// Starts and watches the processes of a fleet for `tandem launch`.
//
// Children are fork/exec'd (before this process touches UCX: UCX state does
// not survive fork), each in its own process group (a terminal's Ctrl-C
// reaches only the launcher, which then stops them in order) and with
// PR_SET_PDEATHSIG so none outlives a launcher killed with SIGKILL.
//
// Readiness: every child gets `--ready-fd N` and writes one JSON line,
// {"grpc": "host:port", "metrics": "host:port"}, once it serves; then the
// launcher knows the real ports (a configured port of 0 picks a free one).
//
// Thread-safety: single-threaded; call everything from the launcher's main
// thread.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <deque>
#include <string>
#include <vector>

#include "common/status.h"

namespace tandem::cli {

struct ChildSpec {
  std::string name;  // e.g. "prefill-0"
  std::string role;  // proxy | prefill | decode | both
  std::vector<std::string> argv;  // argv[0] is the program
};

struct Child {
  ChildSpec spec;
  pid_t pid = -1;
  std::string grpc;     // from the ready line
  std::string metrics;  // from the ready line
  std::string http;     // proxy only
  bool alive = false;
  int exit_status = 0;  // as from waitpid, once !alive
  std::string internal;  // proxy only: the Registry listener (proxy.internal)
  bool death_reported = false;  // WaitForSignalOrDeath returned for this death
  bool draining = false;  // Drain sent it SIGTERM: its exit is expected
};

class Supervisor {
 public:
  Supervisor();
  ~Supervisor();  // stops whatever is still running (SIGKILL after a short grace)

  // Starts `spec` and waits up to `timeout` for its ready line. On failure
  // the child is killed and reaped before returning.
  Result<Child*> Start(ChildSpec spec, std::chrono::milliseconds timeout);

  // Blocks until SIGINT/SIGTERM arrives (returns the signal number) or, when
  // `stop_if_dead` names a child that dies, returns 0 (once per death; its
  // name in `*died` when given). Deaths of other children are logged and
  // the rest keep running.
  int WaitForSignalOrDeath(const std::vector<std::string>& stop_if_dead,
                           std::string* died = nullptr);
  // The same, but returns -1 once `max_wait` passed without either.
  int WaitForSignalOrDeath(const std::vector<std::string>& stop_if_dead,
                           std::chrono::milliseconds max_wait, std::string* died = nullptr);

  // SIGTERM to one live child (its graceful drain, e.g. a worker leaving an
  // autoscaled fleet) without waiting; its exit is then logged as expected.
  // False when no live child has that name.
  bool Drain(const std::string& name);

  // SIGTERM to every live child in reverse start order, then SIGKILL to any
  // still alive after `grace`. Returns the number that had to be killed.
  int StopAll(std::chrono::milliseconds grace);
  // The same for the live children of one role only.
  int StopRole(const std::string& role, std::chrono::milliseconds grace);

  const std::deque<Child>& children() const { return children_; }

 private:
  void ReapExited();

  std::deque<Child> children_;  // deque: Child* stays valid as more start
  int signal_fd_ = -1;
  bool stopping_ = false;  // set by StopRole: exits are then expected
};

// "prefill-0 (pid 123) exited with status 1" / "... was killed by signal 9".
std::string DescribeExit(const Child& c);

}  // namespace tandem::cli
