#include "kvtransfer/transport_base.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>

#include "common/check.h"

namespace tandem::kvtransfer::detail {
namespace {

template <typename T>
void PutInt(std::string& out, T v) {
  for (size_t i = 0; i < sizeof(T); ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
template <typename T>
T GetInt(std::string_view in, size_t pos) {
  T v = 0;
  for (size_t i = 0; i < sizeof(T); ++i) {
    v |= static_cast<T>(static_cast<uint8_t>(in[pos + i])) << (8 * i);
  }
  return v;
}

// Idle rounds (nothing completed, nothing issued) spent spinning before the
// progress thread starts sleeping 1 ms at a time while transfers wait.
constexpr int kSpinRoundsBeforeSleep = 2000;
// With nothing in flight, keep polling this long after the last notice
// arrived before sleeping: a stream of incoming notices is then drained
// without one sleep/wake-up per notice (which, on a busy host, lets the
// sender's shared-memory queue fill and stall it; with no window, 4
// transfers in flight lose ~20 % of their bandwidth here). Only arrivals
// open the window: a writer whose own transfers completed sleeps at once,
// and its next Post wakes it (issue 23: the window after every completed
// write was most of a prefiller's progress-thread CPU). 50 us moves as
// much as the 200 it was (bench/results/proxy_cost/session-30.md).
constexpr auto kPollAfterNotice = std::chrono::microseconds(50);
constexpr auto kReleaseDeadline = std::chrono::seconds(5);

}  // namespace

std::string EncodeNotice(uint64_t target_generation, uint64_t sender_generation,
                         std::string_view sender, std::string_view payload) {
  std::string out;
  out.reserve(20 + sender.size() + payload.size());
  PutInt<uint64_t>(out, target_generation);
  PutInt<uint64_t>(out, sender_generation);
  PutInt<uint32_t>(out, static_cast<uint32_t>(sender.size()));
  out.append(sender);
  out.append(payload);
  return out;
}

Result<DecodedNotice> DecodeNotice(std::string_view wire) {
  if (wire.size() < 20) return InvalidArgumentError("KV notice: truncated header");
  DecodedNotice d;
  d.target_generation = GetInt<uint64_t>(wire, 0);
  d.notification.sender_generation = GetInt<uint64_t>(wire, 8);
  const uint32_t name_bytes = GetInt<uint32_t>(wire, 16);
  if (wire.size() - 20 < name_bytes) return InvalidArgumentError("KV notice: truncated sender");
  d.notification.sender.assign(wire.substr(20, name_bytes));
  d.notification.payload.assign(wire.substr(20 + name_bytes));
  return d;
}

TransportBase::TransportBase(const TransportOptions& options)
    : Transport(options.agent_name, options.generation ? options.generation : NewGeneration(),
                options.block_bytes, options.num_blocks, options.staging_blocks),
      options_(options),
      creator_pid_(getpid()) {}

TransportBase::~TransportBase() {
  TANDEM_CHECK(shut_down_ || !progress_thread_.joinable(),
               "backend destructor must call Shutdown() first");
}

void TransportBase::StartProgressThread() {
  progress_thread_ = std::jthread([this](std::stop_token stop) { ProgressLoop(stop); });
}

void TransportBase::Shutdown() {
  if (shut_down_) return;
  shut_down_ = true;
  if (!progress_thread_.joinable()) return;
  std::vector<PeerId> ids;
  {
    std::lock_guard lock(mu_);
    for (const auto& [id, p] : peers_) ids.push_back(id);
  }
  for (PeerId id : ids) {
    Status s = ReleasePeer(id);
    if (!s.ok()) spdlog::warn("kvtransfer: releasing peer {} at shutdown: {}", id, s.ToString());
  }
  progress_thread_.request_stop();
  Wake();
  progress_thread_.join();
}

Status TransportBase::CheckNotForked() const {
  if (getpid() != creator_pid_) {
    return FailedPreconditionError(fmt::format(
        "kvtransfer: transport created in process {} used in forked child {}; transport state "
        "does not survive fork(): fork/exec workers before creating transports",
        creator_pid_, getpid()));
  }
  return Status::Ok();
}

Status TransportBase::CheckPeerUsable(const PeerEntry& p) const {
  if (p.releasing)
    return CancelledError(fmt::format("peer {} is being released", p.desc.agent_name));
  auto it = latest_generation_.find(p.desc.agent_name);
  if (it != latest_generation_.end() && it->second > p.desc.generation) {
    return FailedPreconditionError(fmt::format(
        "stale descriptor: peer {} generation {} was replaced by generation {} (it restarted)",
        p.desc.agent_name, p.desc.generation, it->second));
  }
  if (p.failed) return p.failure;
  return Status::Ok();
}

Status TransportBase::RunOnProgressThread(std::function<Status()> fn) {
  if (std::this_thread::get_id() == progress_thread_.get_id()) return fn();
  auto done = std::make_shared<std::promise<Status>>();
  std::future<Status> result = done->get_future();
  {
    std::lock_guard lock(mu_);
    commands_.push_back([fn = std::move(fn), done] { done->set_value(fn()); });
  }
  Wake();
  return result.get();
}

Result<PeerId> TransportBase::ImportPeer(std::string_view descriptor) {
  TANDEM_RETURN_IF_ERROR(CheckNotForked());
  TANDEM_ASSIGN_OR_RETURN(PeerDescriptor desc, ParseDescriptor(descriptor));
  const std::string backend = capabilities().backend;
  if (desc.backend != backend) {
    return InvalidArgumentError(fmt::format(
        "KV descriptor is for backend '{}'; this transport is '{}'", desc.backend, backend));
  }
  if (desc.block_bytes == 0 || desc.num_blocks == 0) {
    return InvalidArgumentError("KV descriptor describes an empty pool");
  }
  PeerId id = 0;
  bool stop_peer = false;
  {
    std::lock_guard lock(mu_);
    auto it = latest_generation_.find(desc.agent_name);
    if (it != latest_generation_.end() && desc.generation < it->second) {
      return FailedPreconditionError(fmt::format(
          "stale descriptor: peer {} generation {} is older than generation {} already imported "
          "(the peer restarted)",
          desc.agent_name, desc.generation, it->second));
    }
    for (const auto& [pid, p] : peers_) {  // one endpoint per live peer
      if (p->desc.agent_name == desc.agent_name && p->desc.generation == desc.generation &&
          !p->failed && !p->releasing) {
        return pid;
      }
    }
    latest_generation_[desc.agent_name] = desc.generation;
    id = next_peer_id_++;
    stop_peer = options_.fault.stop_peer_at_import != 0 &&
                ++fault_imports_ == options_.fault.stop_peer_at_import;
  }
  if (stop_peer) {  // fault injection: the peer stops before it can answer our handshake
    const Status stopped = StopLocalProcess(desc.process);
    if (stopped.ok()) faults_injected_++;
    spdlog::warn("kvtransfer: injected fault stop_peer_at_import={}: process {} of {}: {}",
                 options_.fault.stop_peer_at_import, desc.process.pid, desc.agent_name,
                 stopped.ok() ? "stopped (SIGSTOP) before its endpoint is made" : stopped.ToString());
  }
  auto entry = std::make_shared<std::unique_ptr<PeerEntry>>(std::make_unique<PeerEntry>());
  (*entry)->id = id;
  (*entry)->desc = desc;
  Status s = RunOnProgressThread([this, entry, id] {
    auto state = ConnectPeer(id, (*entry)->desc);
    if (!state.ok()) return state.status();
    (*entry)->state = std::move(state).value();
    std::lock_guard lock(mu_);
    peers_[id] = std::move(*entry);
    return Status::Ok();
  });
  if (!s.ok()) return s.WithContext(fmt::format("importing peer {}", desc.agent_name));
  return id;
}

Status TransportBase::ReleasePeer(PeerId peer) {
  TANDEM_RETURN_IF_ERROR(CheckNotForked());
  if (std::this_thread::get_id() == progress_thread_.get_id()) {
    return FailedPreconditionError("ReleasePeer may not be called from a transport callback");
  }
  std::future<Status> released;
  {
    std::lock_guard lock(mu_);
    auto it = peers_.find(peer);
    if (it == peers_.end() || it->second->releasing) {
      return NotFoundError(fmt::format("no peer {}", peer));
    }
    it->second->releasing = true;
    it->second->release_deadline = std::chrono::steady_clock::now() + kReleaseDeadline;
    released = it->second->released.get_future();
    for (auto& [xid, x] : xfers_) {
      if (x->peer == peer) x->abort.store(true);
    }
  }
  Wake();
  return released.get();
}

Result<std::string> TransportBase::TransportsInUse(PeerId peer) {
  TANDEM_RETURN_IF_ERROR(CheckNotForked());
  auto out = std::make_shared<std::string>();
  Status s = RunOnProgressThread([this, peer, out]() -> Status {
    PeerEntry* p = nullptr;
    {
      std::lock_guard lock(mu_);
      auto it = peers_.find(peer);
      if (it == peers_.end()) return NotFoundError(fmt::format("no peer {}", peer));
      p = it->second.get();
    }
    TANDEM_ASSIGN_OR_RETURN(*out, DescribePeerTransports(*p->state));
    return Status::Ok();
  });
  if (!s.ok()) return s;
  return *out;
}

Result<XferId> TransportBase::PrepareWrite(PeerId peer, std::vector<Segment> segments,
                                           std::optional<std::string> notice) {
  TANDEM_RETURN_IF_ERROR(CheckNotForked());
  if (segments.empty() && !notice) {
    return InvalidArgumentError("a write needs at least one segment or a notice");
  }
  const uint64_t max_notice = capabilities().max_notification_bytes;
  if (notice && notice->size() > max_notice) {
    return InvalidArgumentError(fmt::format("notice has {} bytes; this transport sends at most {}",
                                            notice->size(), max_notice));
  }
  std::lock_guard lock(mu_);
  auto it = peers_.find(peer);
  if (it == peers_.end()) return NotFoundError(fmt::format("no peer {}", peer));
  const PeerEntry& p = *it->second;
  TANDEM_RETURN_IF_ERROR(CheckPeerUsable(p));
  uint64_t total = 0;
  for (size_t i = 0; i < segments.size(); ++i) {
    const Segment& s = segments[i];
    if (s.length_bytes == 0 || s.local_offset_bytes > local_bytes() ||
        s.length_bytes > local_bytes() - s.local_offset_bytes ||
        s.remote_offset_bytes > p.desc.pool_bytes() ||
        s.length_bytes > p.desc.pool_bytes() - s.remote_offset_bytes) {
      return OutOfRangeError(fmt::format(
          "segment {} (local {} remote {} length {}) is empty or outside the pools (local {} "
          "bytes, remote {} bytes)",
          i, s.local_offset_bytes, s.remote_offset_bytes, s.length_bytes, local_bytes(),
          p.desc.pool_bytes()));
    }
    total += s.length_bytes;
  }
  auto x = std::make_unique<Xfer>();
  x->id = next_xfer_id_++;
  x->peer = peer;
  x->segments = std::move(segments);
  x->notice = std::move(notice);
  x->total_bytes = total;
  const XferId id = x->id;
  xfers_[id] = std::move(x);
  return id;
}

Status TransportBase::Post(XferId xfer, XferCallback on_done) {
  TANDEM_RETURN_IF_ERROR(CheckNotForked());
  {
    std::lock_guard lock(mu_);
    auto it = xfers_.find(xfer);
    if (it == xfers_.end()) return NotFoundError(fmt::format("no transfer {}", xfer));
    Xfer* x = it->second.get();
    if (x->status != XferStatus::kPrepared) {
      return FailedPreconditionError(
          fmt::format("transfer {} is {}, not prepared", xfer, XferStatusName(x->status)));
    }
    auto pit = peers_.find(x->peer);
    Status usable =
        pit == peers_.end() ? CancelledError("peer released") : CheckPeerUsable(*pit->second);
    if (!usable.ok()) {
      x->status = usable.code() == StatusCode::kFailedPrecondition ? XferStatus::kErrStaleDescriptor
                  : usable.code() == StatusCode::kCancelled        ? XferStatus::kErrCanceled
                                                            : XferStatus::kErrRemoteDisconnect;
      x->detail = usable;
      return usable;
    }
    x->status = XferStatus::kInProgress;
    x->on_done = std::move(on_done);
    x->in_active = true;
    ++inflight_;
    std::chrono::milliseconds fault_delay{0};
    if (options_.fault.enabled() && x->total_bytes > 0) {
      fault_delay = InjectFaults(*x, *pit->second);
    }
    if (x->fault_fail) {
      commands_.push_back([this, x] {
        Finish(*x, XferStatus::kErrBackend,
               InternalError(fmt::format("injected fault ({} fail_every={}): write failed before "
                                         "any byte moved",
                                         kKvFaultEnv, options_.fault.fail_every)));
        active_.push_back(x);  // SweepActive drops it
      });
    } else if (x->fault_lose_peer) {
      commands_.push_back([this, x] {
        active_.push_back(x);  // OnPeerFailed ends it with the peer's other writes
        const uint32_t n = options_.fault.lose_peer_at;
        OnPeerFailed(x->peer, UnavailableError(fmt::format(
                                  "injected fault ({} lose_peer_at={}): peer declared lost at "
                                  "data write {} (transfer {})",
                                  kKvFaultEnv, n, n, x->id)));
      });
    } else if (fault_delay.count() > 0) {
      x->fault_in_flight = true;
      const auto due = std::chrono::steady_clock::now() + fault_delay;
      commands_.push_back([this, x, due] { paced_.emplace_back(due, x); });
    } else if (options_.pace_bits_per_s > 0 && x->total_bytes > 0) {
      const auto now = std::chrono::steady_clock::now();
      const double wire_s = static_cast<double>(x->total_bytes) * options_.pace_byte_scale * 8.0 /
                            options_.pace_bits_per_s;
      link_free_at_ = std::max(link_free_at_, now) +
                      std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                          std::chrono::duration<double>(wire_s));
      const auto due = link_free_at_ + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                           std::chrono::duration<double>(options_.pace_latency_s));
      commands_.push_back([this, x, due] { paced_.emplace_back(due, x); });
    } else {
      commands_.push_back([this, x] { active_.push_back(x); });
    }
  }
  Wake();
  return Status::Ok();
}

std::chrono::milliseconds TransportBase::InjectFaults(Xfer& x, const PeerEntry& peer) {
  const KvFaultOptions& f = options_.fault;
  const uint64_t n = ++fault_writes_;
  if (f.fail_every != 0 && n % f.fail_every == 0) {
    x.fault_fail = true;
    faults_injected_++;
    spdlog::warn("kvtransfer: injected fault: data write {} (transfer {}) fails", n, x.id);
    return std::chrono::milliseconds(0);
  }
  if (f.lose_peer_at != 0 && n == f.lose_peer_at) {
    x.fault_lose_peer = true;
    faults_injected_++;
    spdlog::warn("kvtransfer: injected fault: data write {} (transfer {}) declares peer {} ({}) "
                 "lost",
                 n, x.id, peer.id, peer.desc.agent_name);
    return std::chrono::milliseconds(0);
  }
  std::chrono::milliseconds delay{0};
  if (f.delay_ms != 0 && (f.delay_writes == 0 || n <= f.delay_writes)) {
    delay = std::chrono::milliseconds(f.delay_ms);
    faults_injected_++;
    spdlog::warn("kvtransfer: injected fault: data write {} (transfer {}) waits {} ms", n, x.id,
                 f.delay_ms);
  }
  const uint64_t bb = peer.desc.block_bytes;
  if (f.flip_block != 0 && bb != 0 && fault_blocks_ < f.flip_block) {
    for (const Segment& s : x.segments) {
      const uint64_t first = s.remote_offset_bytes / bb;
      const uint64_t last = (s.remote_offset_bytes + s.length_bytes - 1) / bb;
      const uint64_t blocks = last - first + 1;
      if (fault_blocks_ + blocks < f.flip_block) {
        fault_blocks_ += blocks;
        continue;
      }
      const uint64_t block = first + (f.flip_block - fault_blocks_ - 1);
      const uint64_t remote = std::max(s.remote_offset_bytes, block * bb);
      const uint64_t local = s.local_offset_bytes + (remote - s.remote_offset_bytes);
      x.flip_remote_offset = remote;
      x.flip_value = pool()[local] ^ std::byte{0xff};
      fault_blocks_ = f.flip_block;
      faults_injected_++;
      spdlog::warn("kvtransfer: injected fault: block {} written gets byte {} of the peer's pool "
                   "flipped (transfer {})",
                   f.flip_block, remote, x.id);
      break;
    }
  }
  return delay;
}

XferStatus TransportBase::Poll(XferId xfer, Status* detail) {
  if (Status s = CheckNotForked(); !s.ok()) {
    if (detail) *detail = s;
    return XferStatus::kErrBackend;
  }
  std::lock_guard lock(mu_);
  auto it = xfers_.find(xfer);
  if (it == xfers_.end()) {
    if (detail) *detail = NotFoundError(fmt::format("no transfer {}", xfer));
    return XferStatus::kErrInvalidArgument;
  }
  if (detail) *detail = it->second->detail;
  return it->second->status;
}

uint64_t TransportBase::BytesDone(XferId xfer) {
  std::lock_guard lock(mu_);
  auto it = xfers_.find(xfer);
  return it == xfers_.end() ? 0 : it->second->bytes_done.load();
}

Status TransportBase::Abort(XferId xfer) {
  TANDEM_RETURN_IF_ERROR(CheckNotForked());
  {
    std::lock_guard lock(mu_);
    auto it = xfers_.find(xfer);
    if (it == xfers_.end()) return NotFoundError(fmt::format("no transfer {}", xfer));
    Xfer* x = it->second.get();
    if (x->status == XferStatus::kPrepared) {
      x->status = XferStatus::kErrCanceled;
      x->detail = CancelledError("aborted before it was posted");
      return Status::Ok();
    }
    if (IsTerminal(x->status)) return Status::Ok();
    x->abort.store(true);
  }
  Wake();
  return Status::Ok();
}

Status TransportBase::Release(XferId xfer) {
  TANDEM_RETURN_IF_ERROR(CheckNotForked());
  {
    std::lock_guard lock(mu_);
    auto it = xfers_.find(xfer);
    if (it == xfers_.end()) return NotFoundError(fmt::format("no transfer {}", xfer));
    Xfer* x = it->second.get();
    if (!x->in_active) {
      xfers_.erase(it);
      return Status::Ok();
    }
    x->released = true;
    x->abort.store(true);
    x->on_done = nullptr;
  }
  Wake();
  return Status::Ok();
}

std::vector<Notification> TransportBase::TakeNotifications() {
  std::lock_guard lock(mu_);
  std::vector<Notification> out(std::make_move_iterator(notices_.begin()),
                                std::make_move_iterator(notices_.end()));
  notices_.clear();
  return out;
}

void TransportBase::SetNotificationCallback(NotificationCallback cb) {
  notice_cb_.Set(std::move(cb));
}

TransportStats TransportBase::stats() const {
  std::lock_guard lock(mu_);
  TransportStats s;
  s.live_peers = peers_.size();
  s.live_remote_keys = live_remote_keys_.load();
  s.live_requests = xfers_.size();
  s.inflight_requests = inflight_;
  s.bytes_written = bytes_written_.load();
  s.puts_posted = puts_posted_.load();
  s.notifications_sent = notifications_sent_.load();
  s.notifications_received = notifications_received_;
  s.stale_notifications_dropped = stale_notifications_dropped_;
  s.faults_injected = faults_injected_.load();
  s.handshakes_waiting_on_live_peers = handshakes_waiting_on_live_peers_.load();
  s.progress_idle_polls = idle_polls_.load(std::memory_order_relaxed);
  s.progress_sleeps = idle_sleeps_.load(std::memory_order_relaxed);
  return s;
}

void TransportBase::Finish(Xfer& x, XferStatus status, Status detail) {
  if (x.finished) return;
  x.finished = true;
  x.phase = Phase::kDone;
  XferCallback cb;
  {
    std::lock_guard lock(mu_);
    x.status = status;
    x.detail = detail;
    cb = std::move(x.on_done);
    x.on_done = nullptr;
    --inflight_;
  }
  if (cb) cb(x.id, status, detail);
}

void TransportBase::OnPeerFailed(PeerId peer, const Status& why) {
  std::string agent;
  uint64_t generation = 0;
  {
    std::lock_guard lock(mu_);
    auto it = peers_.find(peer);
    if (it == peers_.end() || it->second->failed) return;
    it->second->failed = true;
    it->second->failed_seen = true;
    it->second->failure = why;
    agent = it->second->desc.agent_name;
    generation = it->second->desc.generation;
  }
  // Transfers to it fail: a warning. With none in flight nothing was lost
  // here (most often a peer that stopped in order, e.g. a fleet's workers
  // stopped together); the proxy warns of a worker it lost, and a decoder of
  // the quarantined reservations a dead prefiller leaves: info.
  size_t lost = 0;
  for (Xfer* x : active_) lost += x->peer == peer ? 1 : 0;
  spdlog::log(lost > 0 ? spdlog::level::warn : spdlog::level::info,
              "kvtransfer: peer {} ({} generation {}) failed with {} transfers in flight: {}", peer,
              agent, generation, lost, why.ToString());
  for (Xfer* x : active_) {
    if (x->peer == peer) Finish(*x, XferStatus::kErrRemoteDisconnect, why);
  }
  peer_failure_cb_.Call([] {}, agent, generation, why);
}

void TransportBase::SetPeerFailureCallback(PeerFailureCallback cb) {
  peer_failure_cb_.Set(std::move(cb));
}

void TransportBase::DeliverNotice(std::string_view wire) {
  auto decoded = DecodeNotice(wire);
  if (!decoded.ok()) {
    spdlog::warn("kvtransfer: dropping malformed notice: {}", decoded.status().ToString());
    return;
  }
  {
    std::lock_guard lock(mu_);
    if (decoded->target_generation != CurrentGeneration()) {
      ++stale_notifications_dropped_;
      return;
    }
    ++notifications_received_;
  }
  Notification& n = decoded->notification;
  notice_cb_.Call(
      [&] {
        std::lock_guard lock(mu_);
        notices_.push_back(std::move(n));
      },
      std::move(n));
}

void TransportBase::RunCommands() {
  std::deque<std::function<void()>> cmds;
  {
    std::lock_guard lock(mu_);
    cmds.swap(commands_);
  }
  for (auto& c : cmds) c();
}

void TransportBase::SweepActive() {
  for (Xfer* x : active_) {
    if (x->finished) continue;
    PeerEntry* p = nullptr;
    {
      std::lock_guard lock(mu_);
      auto it = peers_.find(x->peer);
      if (it != peers_.end()) p = it->second.get();
    }
    if (p == nullptr) {
      Finish(*x, XferStatus::kErrCanceled, CancelledError("peer released"));
    } else if (p->failed_seen) {
      Finish(*x, XferStatus::kErrRemoteDisconnect, p->failure);
    } else {
      Advance(*x, *p);
    }
  }
  // Drop finished transfers with nothing outstanding.
  auto done = [](const Xfer* x) { return x->finished && x->outstanding == 0; };
  if (std::none_of(active_.begin(), active_.end(), done)) return;
  std::lock_guard lock(mu_);
  std::erase_if(active_, [&](Xfer* x) {
    if (!done(x)) return false;
    x->in_active = false;
    if (x->released) xfers_.erase(x->id);
    return true;
  });
}

void TransportBase::SweepReleasingPeers() {
  std::vector<PeerEntry*> releasing;
  {
    std::lock_guard lock(mu_);
    for (auto& [id, p] : peers_) {
      if (p->releasing) releasing.push_back(p.get());
    }
  }
  const auto now = std::chrono::steady_clock::now();
  for (PeerEntry* p : releasing) {
    bool busy = false;
    for (Xfer* x : active_) {
      if (x->peer != p->id) continue;
      if (x->outstanding > 0)
        busy = true;
      else
        Finish(*x, XferStatus::kErrCanceled, CancelledError("peer released"));
    }
    if (busy && now < p->release_deadline) continue;
    for (Xfer* x : active_) {
      if (x->peer == p->id) Finish(*x, XferStatus::kErrCanceled, CancelledError("peer released"));
    }
    if (p->state) DisconnectPeer(*p->state);
    p->state.reset();
    std::unique_ptr<PeerEntry> gone;
    {
      std::lock_guard lock(mu_);
      auto it = peers_.find(p->id);
      gone = std::move(it->second);
      peers_.erase(it);
    }
    gone->released.set_value(busy ? DeadlineExceededError("peer released with operations still "
                                                          "outstanding after 5 s")
                                  : Status::Ok());
  }
}

void TransportBase::ReleaseDuePaced() {
  if (paced_.empty()) return;
  const auto now = std::chrono::steady_clock::now();
  // An aborted (or released) write leaves at once: Advance finishes it
  // without moving a byte. Not one the fault hook holds "on the wire".
  std::erase_if(paced_, [&](const auto& entry) {
    if (entry.first > now && (!entry.second->abort.load() || entry.second->fault_in_flight)) {
      return false;
    }
    active_.push_back(entry.second);
    return true;
  });
}

int TransportBase::IdleWaitMs() const {
  std::lock_guard lock(mu_);
  // No peer: nothing can happen here that does not wake the thread (a
  // command, a post, an incoming connection or notice on the backend's
  // event fd), so it sleeps until then (issue 23: it woke every 100 ms).
  if (peers_.empty()) return -1;
  for (const auto& [_, p] : peers_) {
    if (p->releasing) return static_cast<int>(options_.idle_wait_ms);
  }
  // Connected peers: the backend's keep-alive (UCX: every peer_timeout_s / 3)
  // runs from progress calls; progress a few times per keep-alive period.
  const int keepalive_ms = std::max(100, static_cast<int>(options_.peer_timeout_s * 1000 / 3));
  return std::max(static_cast<int>(options_.idle_wait_ms), keepalive_ms / 4);
}

void TransportBase::ProgressLoop(std::stop_token stop) {
  int idle_rounds = 0;
  std::chrono::steady_clock::time_point last_notice{};  // none yet
  uint64_t notices_seen = 0;  // received or dropped as stale, as counted in stats()
  while (!stop.stop_requested()) {
    RunCommands();
    ReleaseDuePaced();
    bool busy = false;
    for (int i = 0; i < 64 && ProgressOnce(); ++i) busy = true;
    const uint64_t puts_before = puts_posted_.load(std::memory_order_relaxed);
    const size_t active_before = active_.size();
    SweepActive();
    SweepReleasingPeers();
    busy = busy || puts_posted_.load(std::memory_order_relaxed) != puts_before ||
           active_.size() != active_before;
    bool pending_commands = false;
    uint64_t notices = 0;
    {
      std::lock_guard lock(mu_);
      pending_commands = !commands_.empty();
      notices = notifications_received_ + stale_notifications_dropped_;
    }
    if (notices != notices_seen) {
      notices_seen = notices;
      last_notice = std::chrono::steady_clock::now();
    }
    if (busy || pending_commands) {
      idle_rounds = 0;
      continue;
    }
    if (active_.empty()) {
      if (std::chrono::steady_clock::now() - last_notice < kPollAfterNotice) {
        idle_polls_.fetch_add(1, std::memory_order_relaxed);
        std::this_thread::yield();
        continue;
      }
      int wait_ms = IdleWaitMs();
      if (!paced_.empty()) {  // wake for the earliest paced write
        auto due = paced_.front().first;
        for (const auto& e : paced_) due = std::min(due, e.first);
        const auto left = due - std::chrono::steady_clock::now();
        if (left < std::chrono::milliseconds(2)) {
          if (left > left.zero()) std::this_thread::sleep_for(left);
          continue;
        }
        const int paced_ms =
            static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(left).count()) - 1;
        wait_ms = wait_ms < 0 ? paced_ms : std::min<int>(wait_ms, paced_ms);
      }
      idle_sleeps_.fetch_add(1, std::memory_order_relaxed);
      WaitForEvents(wait_ms);
    } else if (++idle_rounds > kSpinRoundsBeforeSleep) {
      WaitForEvents(1);  // transfers wait on the peer (e.g. TCP acks): don't burn a core
    } else {
      std::this_thread::yield();
    }
  }
}

}  // namespace tandem::kvtransfer::detail
