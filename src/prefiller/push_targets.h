// The decoders' KV transport endpoints a prefiller pushes to, and what it
// does when its transport declares one lost (docs/failure-handling.md,
// "A decoder's KV endpoint declared lost").
//
// An endpoint is imported once per decoder descriptor and shared by every
// push to that decoder. The transport may declare it lost while the decoder
// is alive (a keep-alive failure under load, a partition that heals, a
// stopped process): its writes end kErrRemoteDisconnect and every later
// write to that PeerId is refused, for good. So a lost endpoint is
// forgotten here at once (the next PeerFor imports the descriptor again:
// a fresh endpoint to a decoder that is alive works), released off the
// transport's threads, and AfterLoss runs what still has to reach the
// decoder (the error notice that frees a reservation we will not fill)
// over the fresh endpoint, only once the lost one is released: none of its
// operations is outstanding any more.
//
// Threads: every method from any thread, the transport's progress thread
// included (nothing here blocks on the transport there). One worker thread
// (a WorkPool of one; the destructor runs what is queued, then joins)
// releases and re-imports, in order; AfterLoss callbacks run on it.
#pragma once

#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <string>

#include "common/status.h"
#include "common/work_pool.h"
#include "kvtransfer/transport.h"

namespace tandem::prefiller {

class PushTargets {
 public:
  explicit PushTargets(kvtransfer::Transport& transport);
  PushTargets(const PushTargets&) = delete;
  PushTargets& operator=(const PushTargets&) = delete;

  // The endpoint for a decoder's (binary) transport descriptor: the one
  // imported before, unless it was lost since.
  Result<kvtransfer::PeerId> PeerFor(const std::string& descriptor);
  // The transport declared `peer` (imported from `descriptor`) lost, or
  // refused a write to it as lost: forgets it and releases it (once).
  void Lost(const std::string& descriptor, kvtransfer::PeerId peer);
  // Whether `peer` was declared lost (Lost ran for it).
  bool WasLost(kvtransfer::PeerId peer) const;
  // Lost(descriptor, peer), then on the worker, once `peer` is released:
  // `then` with a fresh endpoint for `descriptor` (or the import's error).
  void AfterLoss(const std::string& descriptor, kvtransfer::PeerId peer,
                 std::function<void(Result<kvtransfer::PeerId>)> then);

 private:
  kvtransfer::Transport& transport_;
  mutable std::mutex mu_;
  std::map<std::string, kvtransfer::PeerId> peers_;  // guarded by mu_: descriptor -> live endpoint
  std::set<kvtransfer::PeerId> lost_;                // guarded by mu_ (ids are never reused)
  WorkPool worker_{1};  // last: its destructor runs what is queued while the rest lives
};

}  // namespace tandem::prefiller
