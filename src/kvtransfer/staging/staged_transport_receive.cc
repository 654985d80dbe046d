// StagedTransport, receiver side: manifests become host->device copies;
// the caller's notices wait for them (staged_transport.h).
#include <spdlog/spdlog.h>

#include "kvtransfer/staging/staged_transport.h"
#include "kvtransfer/staging/staging_notice.h"

namespace tandem::kvtransfer {

using staging::DecodeStagingNotice;
using staging::StagingNotice;

// ---------------------------------------------------------------- receiver

void StagedTransport::OnInnerNotice(Notification n) {
  auto decoded = DecodeStagingNotice(n.payload);
  if (!decoded.ok()) {
    {
      std::lock_guard lock(mu_);
      ++counters_.malformed_notices;
    }
    spdlog::warn("kvtransfer staging: dropped a notice from {}: {}", n.sender,
                 decoded.status().ToString());
    return;
  }
  if (!decoded->has_value()) {  // a plain transport's notice: no staging, hand it on
    Deliver({std::move(n)});
    return;
  }
  if (!staged_.receive) {  // send-only: no mirror the ranges could name
    {
      std::lock_guard lock(mu_);
      ++counters_.malformed_notices;
    }
    spdlog::warn("kvtransfer staging: dropped a staging notice from {}: this transport is "
                 "send-only (no host mirror)",
                 n.sender);
    return;
  }
  StagingNotice& sn = **decoded;
  const RecvKey key{n.sender, n.sender_generation};
  std::vector<Notification> ready;
  {
    std::lock_guard lock(mu_);
    RecvPeer& rp = recv_peers_[key];
    if (sn.kind == StagingNotice::Kind::kUser) {
      n.payload = std::move(sn.payload);
      rp.held.emplace_back(sn.count, std::move(n));
      while (!rp.failed && !rp.held.empty() && rp.held.front().first <= rp.h2d_done) {
        ready.push_back(std::move(rp.held.front().second));
        rp.held.pop_front();
        Trace(StageEvent::Kind::kNoticeDelivered, 0, 0);
      }
    } else {
      ++counters_.manifests_received;
      std::vector<CopyRange> ranges;
      bool bad = false;
      for (const staging::Range& r : sn.ranges) {
        if (r.length == 0 || r.offset > pool_bytes() || r.length > pool_bytes() - r.offset) {
          bad = true;
          break;
        }
        ranges.push_back({device_pool_ + r.offset, inner_->pool() + r.offset, r.length});
      }
      if (bad || shutting_down_) {
        ++counters_.malformed_notices;
        rp.failed = true;  // its notices would claim data that is not there
        spdlog::error("kvtransfer staging: manifest from {} outside the pool; its notices are held",
                      n.sender);
      } else {
        Trace(StageEvent::Kind::kH2dStart, 0, 0);
        Status st = engine_->CopyAsync(CopyKind::kHostToDevice, ranges,
                                       [this, key](const Status& s) { OnH2dDone(key, s); });
        if (!st.ok()) {
          ++counters_.h2d_failures;
          rp.failed = true;
          spdlog::error("kvtransfer staging: host-to-device copy for {} not queued: {}", n.sender,
                        st.ToString());
        }
      }
    }
  }
  Deliver(std::move(ready));
}

void StagedTransport::OnH2dDone(const RecvKey& key, const Status& st) {
  std::vector<Notification> ready;
  {
    std::lock_guard lock(mu_);
    RecvPeer& rp = recv_peers_[key];
    Trace(StageEvent::Kind::kH2dDone, 0, 0);
    if (!st.ok()) {
      ++counters_.h2d_failures;
      rp.failed = true;
      spdlog::error("kvtransfer staging: host-to-device copy for {} failed: {}; its notices are held",
                    key.sender, st.ToString());
    } else {
      ++rp.h2d_done;
      ++counters_.h2d_copies_done;
    }
    while (!rp.failed && !rp.held.empty() && rp.held.front().first <= rp.h2d_done) {
      ready.push_back(std::move(rp.held.front().second));
      rp.held.pop_front();
      Trace(StageEvent::Kind::kNoticeDelivered, 0, 0);
    }
  }
  Deliver(std::move(ready));
}

void StagedTransport::Deliver(std::vector<Notification> ready) {
  for (auto& n : ready) {
    user_cb_.Call(
        [&] {
          std::lock_guard lock(mu_);
          notices_.push_back(std::move(n));
        },
        std::move(n));
  }
}

std::vector<Notification> StagedTransport::TakeNotifications() {
  std::lock_guard lock(mu_);
  std::vector<Notification> out(std::make_move_iterator(notices_.begin()),
                                std::make_move_iterator(notices_.end()));
  notices_.clear();
  return out;
}

void StagedTransport::SetNotificationCallback(NotificationCallback cb) {
  user_cb_.Set(std::move(cb));
}

}  // namespace tandem::kvtransfer
