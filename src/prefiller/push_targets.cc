#include "prefiller/push_targets.h"

#include <spdlog/spdlog.h>

namespace tandem::prefiller {

PushTargets::PushTargets(kvtransfer::Transport& transport)
    : transport_(transport),
      worker_([this](std::stop_token stop) { WorkLoop(stop); }) {}

PushTargets::~PushTargets() {
  worker_.request_stop();
  cv_.notify_all();
  if (worker_.joinable()) worker_.join();
}

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
    ++losses_;
    if (auto it = peers_.find(descriptor); it != peers_.end() && it->second == peer) peers_.erase(it);
  }
  spdlog::warn("kvtransfer endpoint {} to a decoder was declared lost; the next push to it "
               "imports its descriptor again",
               peer);
  // ReleasePeer waits for the endpoint's outstanding operations (bounded by
  // the transport) and may not run on its progress thread: the worker does it.
  Run([this, peer] {
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
  Run([this, descriptor, then = std::move(then)] { then(PeerFor(descriptor)); });
}

uint64_t PushTargets::losses() const {
  std::lock_guard lock(mu_);
  return losses_;
}

void PushTargets::Run(std::function<void()> task) {
  {
    std::lock_guard lock(mu_);
    tasks_.push_back(std::move(task));
  }
  cv_.notify_all();
}

void PushTargets::WorkLoop(std::stop_token stop) {
  std::unique_lock lock(mu_);
  while (true) {
    cv_.wait(lock, stop, [this] { return !tasks_.empty(); });
    if (tasks_.empty()) return;  // stopped with nothing left to do
    std::function<void()> task = std::move(tasks_.front());
    tasks_.pop_front();
    lock.unlock();
    task();
    lock.lock();
  }
}

}  // namespace tandem::prefiller
