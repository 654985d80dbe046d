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
// Worker groups (issue 18, docs/parallelism.md "Rank processes"): a worker
// of tensor_parallel x pipeline_parallel ranks is several children with
// the same name and `ranks` > 1, rank 0 serving. When any rank of a group
// exits, the rest of the group is killed (SIGKILL): a worker missing a
// rank cannot compute, and the proxy then handles it as any lost worker
// (it leaves routing, its requests retry or migrate). The log names the
// rank and its pid.
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
  uint32_t rank = 0;   // within its worker group (issue 18); 0 serves
  uint32_t ranks = 1;  // the group's size; 1: a plain process
  // "KEY=VALUE" set in its environment (replacing the launcher's value),
  // e.g. CUDA_VISIBLE_DEVICES of a cuda rank.
  std::vector<std::string> env;
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
  bool group_stopped = false;  // killed because another rank of its group exited
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
  // For a worker group: rank 0 drains, the other ranks (which it still
  // needs meanwhile) are marked draining and killed once it exits.
  // False when no live child has that name.
  bool Drain(const std::string& name);

  // SIGKILL to every live rank of the group `name` and reaps them (a group
  // that failed to start). Returns how many were killed.
  int KillGroup(const std::string& name);

  // SIGTERM to every live child in reverse start order, then SIGKILL to any
  // still alive after `grace`. Returns the number that had to be killed.
  int StopAll(std::chrono::milliseconds grace);
  // The same for the live children of one role only.
  int StopRole(const std::string& role, std::chrono::milliseconds grace);

  const std::deque<Child>& children() const { return children_; }

 private:
  void ReapExited();
  // `dead` (a rank of a group) exited: SIGKILL to the group's live ranks.
  void StopRestOfGroup(const Child& dead);

  std::deque<Child> children_;  // deque: Child* stays valid as more start
  int signal_fd_ = -1;
  bool stopping_ = false;  // set by StopRole: exits are then expected
};

// "prefill-0 (pid 123) exited with status 1" / "... was killed by signal 9";
// a rank of a group: "decode-0 rank 1 (pid 124) was killed by signal 9".
std::string DescribeExit(const Child& c);
// "decode-0" or "decode-0 rank 1" (a group of more than one rank).
std::string ChildLabel(const Child& c);

}  // namespace tandem::cli
