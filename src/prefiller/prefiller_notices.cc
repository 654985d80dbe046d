// The notices a prefiller sends a decoder about a reservation it will not
// write into (docs/failure-handling.md "Quarantine"): an aborted push, a
// failed submit, a reservation whose reply came after the call had ended.
// Each one lets the decoder release the blocks at once instead of holding
// them quarantined until this process dies; a notice refused because the
// endpoint was lost goes again over a freshly imported one.
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "common/logging.h"
#include "prefiller/prefiller.h"

namespace tandem::prefiller {

void Prefiller::SendErrorNotice(const JobPtr& job, const Status& why) {
  NoticeSpec n;
  kvtransfer::PeerId peer;
  std::string descriptor;
  {
    std::lock_guard lock(mu_);
    if (!job->have_target || !job->have_peer) return;
    peer = job->peer;
    descriptor = job->target.transport_descriptor;
    n.request_id = job->spec.request_id;
    n.reservation_id = job->target.reservation_id;
    n.generation = job->target.generation;
    n.capability = job->target.capability;
  }
  n.error = why.ok() ? UnknownError() : why;
  TellGaveUp(peer, n, descriptor);
}

void Prefiller::TellGaveUp(kvtransfer::PeerId peer, const NoticeSpec& n,
                           const std::string& descriptor) {
  if (targets_.WasLost(peer)) {
    NoticeAfterLoss(peer, n, descriptor);
  } else {
    PostNotice(peer, n, descriptor, /*retry_after_loss=*/true);
  }
}

void Prefiller::PostNotice(kvtransfer::PeerId peer, const NoticeSpec& n,
                           const std::string& descriptor, bool retry_after_loss) {
  // Refused as lost: the endpoint failed (UNAVAILABLE) or is being or was
  // released (CANCELLED, NOT_FOUND).
  auto lost = [](const Status& s) {
    return s.code() == StatusCode::kUnavailable || s.code() == StatusCode::kCancelled ||
           s.code() == StatusCode::kNotFound;
  };
  auto x = transport_.PrepareWrite(peer, {}, link_.EncodeNotice(n));
  Status s = x.status();
  if (x.ok()) {
    // Only a notice that may be retried needs this prefiller in its
    // callback (which may run as late as the transport's shutdown).
    kvtransfer::Transport* t = &transport_;
    if (retry_after_loss) {
      s = transport_.Post(*x, [t, peer, n, descriptor, retry = lifeline_.Guard([this](
                                  kvtransfer::PeerId p, const NoticeSpec& spec,
                                  const std::string& d) { NoticeAfterLoss(p, spec, d); })](
                                  kvtransfer::XferId id, kvtransfer::XferStatus st,
                                  const Status&) mutable {
        t->Release(id).IgnoreError();
        if (st == kvtransfer::XferStatus::kErrRemoteDisconnect) retry(peer, n, descriptor);
      });
    } else {
      s = transport_.Post(*x, [t](kvtransfer::XferId id, kvtransfer::XferStatus, const Status&) {
        t->Release(id).IgnoreError();
      });
    }
    if (!s.ok()) transport_.Release(*x).IgnoreError();
  }
  if (s.ok()) return;
  if (retry_after_loss && lost(s)) {
    NoticeAfterLoss(peer, n, descriptor);
    return;
  }
  LogRequest(spdlog::level::warn, n.request_id, "cannot tell the decoder we gave up: {}",
             s.message());
}

void Prefiller::NoticeAfterLoss(kvtransfer::PeerId lost, const NoticeSpec& n,
                                const std::string& descriptor) {
  auto then = [this, lost, n, descriptor](Result<kvtransfer::PeerId> fresh) {
    if (!fresh.ok()) {
      LogRequest(spdlog::level::warn, n.request_id,
                 "cannot tell the decoder we gave up: its KV endpoint {} was lost and importing "
                 "it again failed: {}",
                 lost, fresh.status().message());
      return;
    }
    LogRequest(spdlog::level::info, n.request_id,
               "telling the decoder we gave up over a fresh KV endpoint {} (endpoint {} was lost)",
               *fresh, lost);
    PostNotice(*fresh, n, descriptor, /*retry_after_loss=*/false);
  };
  targets_.AfterLoss(descriptor, lost, std::move(then));
}

Status Prefiller::UnknownError() { return Status(StatusCode::kUnknown, "prefiller gave up"); }

void Prefiller::OnLateTarget(const std::string& request_id, const ReserveTarget& target) {
  // Its call ended (DEADLINE_EXCEEDED): the job is over, nothing of it can
  // write into these slots. Without this notice the decoder would keep
  // them quarantined until this process dies: it is alive and watched.
  LogRequest(spdlog::level::warn, request_id,
             "decoder's reservation {} came after our Reserve call had ended; telling it we will "
             "not write into it",
             target.reservation_id);
  auto peer = targets_.PeerFor(target.transport_descriptor);
  if (!peer.ok()) {
    LogRequest(spdlog::level::warn, request_id, "cannot tell the decoder we gave up: {}",
               peer.status().message());
    return;
  }
  NoticeSpec n;
  n.request_id = request_id;
  n.reservation_id = target.reservation_id;
  n.generation = target.generation;
  n.capability = target.capability;
  n.error = DeadlineExceededError(fmt::format(
      "request '{}': the reservation's reply came after the prefiller's Reserve call had ended",
      request_id));
  TellGaveUp(*peer, n, target.transport_descriptor);
}

}  // namespace tandem::prefiller
