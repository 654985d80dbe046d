#include "prefiller/push_targets.h"

#include <spdlog/spdlog.h>

namespace tandem::prefiller {

PushTargets::PushTargets(kvtransfer::Transport& transport) : transport_(transport) {}

Result<kvtransfer::PeerId> PushTargets::PeerFor(const std::string& descriptor) {
  {
    std::lock_guard lock(mu_);
    if (auto it = peers_.find(descriptor); it != peers_.end()) return it->second;
  }
  // The transport returns the endpoint it has for the same agent and
  // generation unless that one failed (then it connects a new one).
  TANDEM_ASSIGN_OR_RETURN(kvtransfer::PeerId peer, transport_.ImportPeer(descriptor));
  std::lock_guard lock(mu_);
  if (!lost_.contains(peer)) peers_[descriptor] = peer;
  return peer;
}

void PushTargets::Lost(const std::string& descriptor, kvtransfer::PeerId peer) {
  {
    std::lock_guard lock(mu_);
    if (!lost_.insert(peer).second) return;  // released (or being released) already
    if (auto it = peers_.find(descriptor); it != peers_.end() && it->second == peer) peers_.erase(it);
  }
  spdlog::warn("kvtransfer endpoint {} to a decoder was declared lost; the next push to it "
               "imports its descriptor again",
               peer);
  // ReleasePeer waits for the endpoint's outstanding operations (bounded by
  // the transport) and may not run on its progress thread: the worker does it.
  worker_.Submit([this, peer] {
    Status s = transport_.ReleasePeer(peer);
    if (!s.ok() && s.code() != StatusCode::kNotFound) {
      spdlog::warn("releasing lost kvtransfer endpoint {}: {}", peer, s.ToString());
    }
  });
}

bool PushTargets::WasLost(kvtransfer::PeerId peer) const {
  std::lock_guard lock(mu_);
  return lost_.contains(peer);
}

void PushTargets::AfterLoss(const std::string& descriptor, kvtransfer::PeerId peer,
                            std::function<void(Result<kvtransfer::PeerId>)> then) {
  Lost(descriptor, peer);
  // Queued behind the release above (or the one an earlier Lost queued).
  worker_.Submit([this, descriptor, then = std::move(then)] { then(PeerFor(descriptor)); });
}

}  // namespace tandem::prefiller
