// The follower rank processes of a group started by its rank 0 (issue 18):
// `tandem generate --tensor-parallel N --pipeline-parallel M` starts ranks
// 1 .. N*M-1 as `/proc/self/exe rank ...` (a worker's ranks are started by
// the launcher instead). Each child gets PR_SET_PDEATHSIG(SIGKILL): it dies
// with the thread that started it, so a crashed or killed rank 0 leaves no
// rank behind; the destructor kills and reaps whatever still runs.
//
// Thread-safety: Start, WaitAll, StopWatching and the destructor on the
// owning thread (the one that must outlive the children: PDEATHSIG follows
// the starting thread); Watch's callback runs on the watcher thread, which
// may call KillAll. The owning thread reaps only after StopWatching.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/status.h"

namespace tandem::parallel {

class RankProcesses {
 public:
  struct Exit {
    uint32_t rank = 0;
    pid_t pid = 0;
    int status = 0;  // waitpid's
    bool clean() const;
    // "rank 2 (pid 1234) was killed by signal 9" / "... exited with status 1"
    std::string Describe() const;
  };

  // Starts `argv_of(rank)` (argv[0] is the program) for ranks 1 .. world-1.
  static Result<std::unique_ptr<RankProcesses>> Start(
      uint32_t world, const std::function<std::vector<std::string>(uint32_t rank)>& argv_of);
  ~RankProcesses();

  RankProcesses(const RankProcesses&) = delete;
  RankProcesses& operator=(const RankProcesses&) = delete;

  // Starts the watcher thread: `on_exit` runs once, on it, for the first
  // rank that exits (for any reason) while watched.
  void Watch(std::function<void(const Exit&)> on_exit);
  void StopWatching();  // joins the watcher
  // SIGKILL to every rank not yet reaped (safe from the watcher callback).
  void KillAll();
  // Waits up to `timeout_ms` for every rank to exit (after the shutdown
  // plan); error naming the first rank that exited non-zero or still runs.
  Status WaitAll(int64_t timeout_ms);

  std::vector<pid_t> pids() const;

 private:
  struct Child {
    uint32_t rank = 0;
    pid_t pid = 0;
    int pidfd = -1;
    bool reaped = false;
    int status = 0;
  };
  RankProcesses() = default;
  // Reaps child `i` if it has exited; true if reaped (now or before).
  bool Reap(size_t i);

  std::vector<Child> children_;
  int stop_fd_ = -1;  // eventfd waking the watcher
  std::thread watcher_;
};

}  // namespace tandem::parallel
