#include "engine/kv_events.h"

#include <utility>

namespace tandem::engine {

KvEventPublisher::KvEventPublisher(uint64_t epoch, size_t queue_capacity)
    : epoch_(epoch), queue_capacity_(queue_capacity) {}

uint64_t KvEventPublisher::last_event_id() const {
  std::lock_guard lock(mu_);
  return next_id_ - 1;
}

uint64_t KvEventPublisher::Subscribe(Callback callback) {
  std::lock_guard lock(mu_);
  const uint64_t id = next_subscription_++;
  subscribers_.emplace(id, std::move(callback));
  return id;
}

uint64_t KvEventPublisher::SubscribeWake(WakeCallback callback) {
  std::lock_guard lock(mu_);
  const uint64_t id = next_subscription_++;
  wake_subscribers_.emplace(id, std::move(callback));
  return id;
}

void KvEventPublisher::Unsubscribe(uint64_t subscription) {
  std::lock_guard lock(mu_);
  subscribers_.erase(subscription);
  wake_subscribers_.erase(subscription);
}

void KvEventPublisher::Hold() {
  std::lock_guard lock(mu_);
  ++holds_;
}

void KvEventPublisher::Release() {
  std::lock_guard lock(mu_);
  if (holds_ == 0 || --holds_ > 0 || !wake_pending_) return;
  WakeLocked();
}

void KvEventPublisher::WakeIfQuiet() {
  std::lock_guard lock(mu_);
  if (!quiet_queued_) return;
  if (holds_ > 0) {
    wake_pending_ = true;
    return;
  }
  WakeLocked();
}

void KvEventPublisher::WakeNow() {
  std::lock_guard lock(mu_);
  if (!quiet_queued_ && !wake_pending_) return;
  // A hold's later release has nothing left to announce for these; what
  // is published after this wake-up sets wake_pending_ again.
  WakeLocked();
}

void KvEventPublisher::WakeLocked() {
  // Every queued event is announced (outside a hold nothing is pending).
  quiet_queued_ = false;
  wake_pending_ = false;
  for (auto& [id, cb] : wake_subscribers_) cb();
}

std::vector<KvEvent> KvEventPublisher::Drain(size_t max_events) {
  std::lock_guard lock(mu_);
  std::vector<KvEvent> out;
  while (!queue_.empty() && out.size() < max_events) {
    out.push_back(std::move(queue_.front()));
    queue_.pop_front();
  }
  if (queue_.empty()) quiet_queued_ = false;  // drained: nothing left to wake for
  return out;
}

void KvEventPublisher::PublishStored(std::vector<uint64_t> hashes, uint64_t parent_hash,
                                     KvTier tier, bool quiet) {
  if (hashes.empty()) return;
  KvEvent e;
  e.tier = tier;
  e.kind = KvEventKind::kStored;
  e.hashes = std::move(hashes);
  e.parent_hash = parent_hash;
  Publish(std::move(e), quiet);
}

void KvEventPublisher::PublishRemoved(std::vector<uint64_t> hashes, KvTier tier, bool quiet) {
  if (hashes.empty()) return;
  KvEvent e;
  e.tier = tier;
  e.kind = KvEventKind::kRemoved;
  e.hashes = std::move(hashes);
  Publish(std::move(e), quiet);
}

void KvEventPublisher::PublishCleared() {
  KvEvent e;
  e.kind = KvEventKind::kCleared;
  Publish(std::move(e), /*quiet=*/false);
}

void KvEventPublisher::Publish(KvEvent event, bool quiet) {
  // Ids are assigned and subscribers called under one lock so that every
  // subscriber sees events in id order.
  std::lock_guard lock(mu_);
  event.event_id = next_id_++;
  event.epoch = epoch_;
  for (auto& [id, cb] : subscribers_) cb(event);
  if (quiet) {
    // Queued only: leaves with the drainer's next wake-up.
    quiet_queued_ = true;
  } else if (holds_ > 0) {
    wake_pending_ = true;
  } else {
    WakeLocked();
  }
  if (queue_capacity_ == 0) return;
  if (queue_.size() >= queue_capacity_) queue_.pop_front();
  queue_.push_back(std::move(event));
}

}  // namespace tandem::engine
