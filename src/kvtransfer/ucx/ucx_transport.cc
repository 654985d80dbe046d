#include "kvtransfer/ucx/ucx_transport.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "kvtransfer/process_identity.h"
#include "kvtransfer/transport_base.h"
#include "kvtransfer/ucx/ucx_config.h"

namespace tandem::kvtransfer {
namespace {

using detail::Phase;
using detail::Xfer;

constexpr unsigned kNoticeAmId = 0x7a;
// The connection handshake (docs/kvtransfer.md, "Peer loss"): one eager
// active message per new endpoint, too long for a short message on any
// transport here (shared memory ~100 B, TCP ~8 kB, verbs inline ~200 B), so
// UCX resolves the peer's endpoint id while we can still bound the wait.
constexpr unsigned kHelloAmId = 0x7b;
constexpr size_t kHelloBytes = 16 << 10;
constexpr uint32_t kMaxOutstandingPerXfer = 8;
// Bytes one Advance call may put before yielding to other transfers and to
// aborts (puts into shared memory complete inside ucp_put_nbx).
constexpr uint64_t kPutBudgetPerAdvanceBytes = 16ull << 20;
constexpr auto kCloseDeadline = std::chrono::seconds(2);

class UcxTransport;

struct UcxPeer : detail::PeerState {
  ucp_ep_h ep = nullptr;
  ucp_rkey_h rkey = nullptr;
  uint64_t remote_base = 0;
  // Argument of the endpoint's error handler; lives as long as the endpoint.
  struct ErrArg {
    UcxTransport* transport = nullptr;
    PeerId peer = 0;
  } err_arg;
  std::string agent;  // the peer's agent name, for errors
  // The handshake's message while UCX holds it; answered: hello is null.
  std::unique_ptr<std::string> hello;
  std::chrono::steady_clock::time_point hello_sent_at;
  // The peer's process, when it runs on this host in our pid namespace
  // (its descriptor says so): an overdue hello then waits while it lives.
  bool local = false;
  ProcessIdentity process;
  std::chrono::steady_clock::time_point next_liveness_check{};
  bool logged_waiting = false;
};

// One outstanding put: how many bytes it carries, for progress accounting.
struct PutOp {
  UcxTransport* transport;
  Xfer* xfer;
  uint64_t bytes;
};

class UcxTransport final : public detail::TransportBase {
 public:
  explicit UcxTransport(const TransportOptions& options) : TransportBase(options) {}

  ~UcxTransport() override {
    Shutdown();
    if (memh_ != nullptr) {
      const ucs_status_t s = ucp_mem_unmap(context_, memh_);
      if (s != UCS_OK) spdlog::warn("kvtransfer: ucp_mem_unmap: {}", ucs_status_string(s));
    }
    if (worker_ != nullptr) ucp_worker_destroy(worker_);
    if (context_ != nullptr) ucp_cleanup(context_);
    if (epoll_fd_ >= 0) close(epoll_fd_);
    if (wake_fd_ >= 0) close(wake_fd_);
    // options().external_pool_owner (a copy in TransportBase) frees the
    // device pool after this, once it is unmapped.
  }

  bool external() const { return options().external_pool != nullptr; }
  bool cuda_pool() const {
    return external() && options().pool_memory == TransportOptions::PoolMemory::kCuda;
  }
  std::string BackendName() const { return cuda_pool() ? "ucx+cuda" : "ucx"; }

  Status Init() {
    ucp_config_t* config = nullptr;
    ucs_status_t s = ucp_config_read(nullptr, nullptr, &config);
    if (s != UCS_OK) return ucx::UcsError("ucp_config_read", s);
    auto applied = ucx::ApplyUcxDefaults(config, options().peer_timeout_s);
    if (!applied.ok()) {
      ucp_config_release(config);
      return applied.status();
    }
    static std::once_flag logged;
    std::call_once(logged, [&] {
      for (const std::string& a : *applied)
        spdlog::info("kvtransfer: UCX default UCX_{} (not set by the operator)", a);
    });
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
    s = ucp_init(&params, config, &context_);
    ucp_config_release(config);
    if (s != UCS_OK) return ucx::UcsError("ucp_init", s);

    ucp_worker_params_t wparams{};
    wparams.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wparams.thread_mode = UCS_THREAD_MODE_SINGLE;  // only the progress thread touches it
    s = ucp_worker_create(context_, &wparams, &worker_);
    if (s != UCS_OK) return ucx::UcsError("ucp_worker_create", s);

    ucp_mem_map_params_t mparams{};
    mparams.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                         UCP_MEM_MAP_PARAM_FIELD_FLAGS;
    mparams.address = nullptr;
    mparams.length = local_bytes();  // the pool, then any staging blocks
    mparams.flags = UCP_MEM_MAP_ALLOCATE;
    if (external()) {
      // transport.device_path direct: register the caller's device pool.
      if (staging_blocks() != 0) {
        return InvalidArgumentError("an external (device) pool takes no staging blocks");
      }
      mparams.field_mask |= UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
      mparams.address = options().external_pool;
      mparams.flags = 0;
      mparams.memory_type = cuda_pool() ? UCS_MEMORY_TYPE_CUDA : UCS_MEMORY_TYPE_HOST;
    }
    s = ucp_mem_map(context_, &mparams, &memh_);
    if (s != UCS_OK) {
      return ucx::UcsError(
          external() ? fmt::format("ucp_mem_map(register {} bytes of {} memory)", local_bytes(),
                                   cuda_pool() ? "CUDA device" : "host")
                     : fmt::format("ucp_mem_map(allocate {} bytes)", local_bytes()),
          s);
    }
    ucp_mem_attr_t attr{};
    attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
    s = ucp_mem_query(memh_, &attr);
    if (s != UCS_OK) return ucx::UcsError("ucp_mem_query", s);
    if (attr.length < local_bytes()) {
      return InternalError(
          fmt::format("ucp_mem_map gave {} bytes, asked {}", attr.length, local_bytes()));
    }
    set_pool(static_cast<std::byte*>(attr.address));

    void* rkey_buf = nullptr;
    size_t rkey_bytes = 0;
    s = ucp_rkey_pack(context_, memh_, &rkey_buf, &rkey_bytes);
    if (s != UCS_OK) return ucx::UcsError("ucp_rkey_pack", s);
    std::string rkey(static_cast<char*>(rkey_buf), rkey_bytes);
    ucp_rkey_buffer_release(rkey_buf);

    ucp_address_t* address = nullptr;
    size_t address_bytes = 0;
    s = ucp_worker_get_address(worker_, &address, &address_bytes);
    if (s != UCS_OK) return ucx::UcsError("ucp_worker_get_address", s);
    std::string addr(reinterpret_cast<char*>(address), address_bytes);
    ucp_worker_release_address(worker_, address);

    ucp_am_handler_param_t am{};
    am.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                    UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
    am.id = kNoticeAmId;
    am.flags = UCP_AM_FLAG_WHOLE_MSG;
    am.cb = &UcxTransport::OnNotice;
    am.arg = this;
    s = ucp_worker_set_am_recv_handler(worker_, &am);
    if (s != UCS_OK) return ucx::UcsError("ucp_worker_set_am_recv_handler", s);
    am.id = kHelloAmId;
    am.cb = &UcxTransport::OnHello;
    s = ucp_worker_set_am_recv_handler(worker_, &am);
    if (s != UCS_OK) return ucx::UcsError("ucp_worker_set_am_recv_handler(hello)", s);

    int worker_fd = -1;
    s = ucp_worker_get_efd(worker_, &worker_fd);
    if (s != UCS_OK) return ucx::UcsError("ucp_worker_get_efd", s);
    epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
    wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (epoll_fd_ < 0 || wake_fd_ < 0) {
      return InternalError(fmt::format("epoll/eventfd: {}", std::strerror(errno)));
    }
    for (int fd : {worker_fd, wake_fd_}) {
      epoll_event ev{};
      ev.events = EPOLLIN;
      ev.data.fd = fd;
      if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev) != 0) {
        return InternalError(fmt::format("epoll_ctl: {}", std::strerror(errno)));
      }
    }

    PeerDescriptor d;
    d.backend = BackendName();
    d.agent_name = agent_name();
    d.generation = generation();
    d.block_bytes = block_bytes();
    d.num_blocks = num_blocks();
    d.remote_base = reinterpret_cast<uint64_t>(pool());
    d.address = std::move(addr);
    d.rkey = std::move(rkey);
    // Lets a peer on this host tell us stopped from gone (CheckHellos).
    d.process = LocalProcessIdentity();
    descriptor_ = SerializeDescriptor(d);
    StartProgressThread();
    return Status::Ok();
  }

  Capabilities capabilities() const override {
    Capabilities c;
    // A device pool is its own backend name: a staged peer (whose
    // descriptor says "ucx") and a direct one refuse each other's
    // descriptors at import instead of mixing wire protocols.
    c.backend = BackendName();
    c.device_memory = cuda_pool();
    c.cross_process = true;
    // Sent with UCP_AM_SEND_FLAG_EAGER (multi-fragment eager above one
    // fragment), so the receiver gets it whole.
    c.max_notification_bytes = kTransportNoticeBytes;
    return c;
  }

  std::string LocalDescriptor() const override { return descriptor_; }

 protected:
  Result<std::unique_ptr<detail::PeerState>> ConnectPeer(PeerId id,
                                                         const PeerDescriptor& desc) override {
    auto p = std::make_unique<UcxPeer>();
    p->err_arg = {this, id};
    p->agent = desc.agent_name;
    p->remote_base = desc.remote_base;
    p->local = desc.process.SameHostAndNamespace(LocalProcessIdentity());
    p->process = desc.process;
    ucp_ep_params_t params{};
    params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                        UCP_EP_PARAM_FIELD_ERR_HANDLER;
    params.address = reinterpret_cast<const ucp_address_t*>(desc.address.data());
    params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    params.err_handler.cb = &UcxTransport::OnEndpointError;
    params.err_handler.arg = &p->err_arg;
    ucs_status_t s = ucp_ep_create(worker_, &params, &p->ep);
    if (s != UCS_OK) return ucx::UcsError("ucp_ep_create", s);
    s = ucp_ep_rkey_unpack(p->ep, desc.rkey.data(), &p->rkey);
    if (s != UCS_OK) {
      CloseEndpoint(p->ep);
      return ucx::UcsError("ucp_ep_rkey_unpack", s);
    }
    live_remote_keys_++;
    SendHello(*p);
    return std::unique_ptr<detail::PeerState>(std::move(p));
  }

  void DisconnectPeer(detail::PeerState& state) override {
    auto& p = static_cast<UcxPeer&>(state);
    if (p.rkey != nullptr) {
      ucp_rkey_destroy(p.rkey);
      p.rkey = nullptr;
      live_remote_keys_--;
    }
    CloseEndpoint(p.ep);  // ends an unanswered hello too (OnHelloDone)
    p.ep = nullptr;
    std::erase(hellos_, &p);
  }

  void Advance(Xfer& x, detail::PeerEntry& entry) override {
    auto& peer = static_cast<UcxPeer&>(*entry.state);
    if (x.abort.load() && (!x.fault_in_flight || x.next_segment == x.segments.size())) {
      x.stopping = true;
    }
    if (!x.op_error.ok()) {
      Finish(x,
             x.op_error.code() == StatusCode::kUnavailable ? XferStatus::kErrRemoteDisconnect
                                                           : XferStatus::kErrBackend,
             x.op_error);
      return;
    }
    switch (x.phase) {
      case Phase::kPut:
        IssuePuts(x, peer);
        if ((x.stopping || x.next_segment == x.segments.size()) && x.outstanding == 0 &&
            x.op_error.ok()) {
          IssueFlush(x, peer);
        }
        return;
      case Phase::kFlushed:
        if (!x.stopping && x.flip_remote_offset && !x.flip_done) {
          // Fault injection: one byte over the landed data, flushed before
          // the notice.
          x.flip_done = true;
          IssueFlipPut(x, peer);
          if (x.op_error.ok()) IssueFlush(x, peer);
          return;
        }
        if (x.stopping) {
          Finish(x, XferStatus::kErrCanceled,
                 CancelledError(fmt::format("aborted after {} of {} bytes", x.bytes_done.load(),
                                            x.total_bytes)));
        } else if (x.notice) {
          SendNotice(x, peer, entry);
        } else {
          Finish(x, XferStatus::kSuccess, Status::Ok());
        }
        return;
      case Phase::kNotice:
        if (x.notice_sent) Finish(x, XferStatus::kSuccess, Status::Ok());
        return;
      case Phase::kFlush:
      case Phase::kDone:
        return;
    }
  }

  bool ProgressOnce() override {
    const bool progressed = ucp_worker_progress(worker_) != 0;
    if (!hellos_.empty()) CheckHellos();
    return progressed;
  }

  void WaitForEvents(int timeout_ms) override {
    const ucs_status_t s = ucp_worker_arm(worker_);
    if (s == UCS_ERR_BUSY) return;  // events pending: progress again
    if (s != UCS_OK) {
      spdlog::warn("kvtransfer: ucp_worker_arm: {}", ucs_status_string(s));
      timeout_ms = std::min(timeout_ms, 1);
    }
    epoll_event events[2];
    const int n = epoll_wait(epoll_fd_, events, 2, timeout_ms);
    for (int i = 0; i < n; ++i) {
      if (events[i].data.fd == wake_fd_) {
        uint64_t v = 0;
        [[maybe_unused]] ssize_t r = read(wake_fd_, &v, sizeof(v));
      }
    }
  }

  void Wake() override {
    const uint64_t one = 1;
    [[maybe_unused]] ssize_t r = write(wake_fd_, &one, sizeof(one));
  }

  Result<std::string> DescribePeerTransports(detail::PeerState& state) override {
    const auto& p = static_cast<UcxPeer&>(state);
    if (p.ep == nullptr) {
      return FailedPreconditionError("the peer's endpoint is closed: it was declared lost");
    }
    return ucx::EndpointTransports(p.ep);
  }

 private:
  // The handshake. UCX 1.13 learns the peer's endpoint id only when a
  // message needs it (any active message that is not a short one); until
  // the peer's reply it keeps a wire-up proxy on the endpoint's active
  // message lane, and its keep-alive skips that lane, so a peer that dies in
  // that window is never reported (docs/kvtransfer.md, "Peer loss"). The
  // hello makes that window the connection's first round trip, where
  // CheckHellos bounds it by peer_timeout_s; afterwards UCX's keep-alive
  // covers the peer whatever is sent. The hello completes only once the
  // proxy is gone (UCX holds it behind the wire-up).
  void SendHello(UcxPeer& p) {
    p.hello = std::make_unique<std::string>(kHelloBytes, '\0');
    p.hello_sent_at = std::chrono::steady_clock::now();
    ucs_status_ptr_t req =
        SendEagerAm(p.ep, kHelloAmId, *p.hello, &UcxTransport::OnHelloDone, &p);
    if (UCS_PTR_IS_ERR(req)) {
      // The endpoint already failed; its error handler reports the peer.
      spdlog::warn("kvtransfer: peer {} handshake: {}", p.err_arg.peer,
                   ucs_status_string(UCS_PTR_STATUS(req)));
      p.hello.reset();
    } else if (req == nullptr) {
      p.hello.reset();
    } else {
      hellos_.push_back(&p);
    }
  }

  static void OnHelloDone(void* request, ucs_status_t /*status*/, void* user_data) {
    // A failure is the endpoint's: its error handler reports it.
    auto& p = *static_cast<UcxPeer*>(user_data);
    p.hello.reset();
    std::erase(p.err_arg.transport->hellos_, &p);
    ucp_request_free(request);
  }

  // [progress] Fails every peer whose hello is unanswered after
  // peer_timeout_s, unless its process is provably alive on this host
  // (OverdueVerdict). Time this thread itself did not run (the process was
  // stopped or starved) is not held against the peers.
  void CheckHellos() {
    const auto now = std::chrono::steady_clock::now();
    const auto bound = std::chrono::duration_cast<std::chrono::steady_clock::duration>(
        std::chrono::duration<double>(options().peer_timeout_s));
    const auto own_gap = std::max<std::chrono::steady_clock::duration>(
        bound / 2, std::chrono::milliseconds(4 * options().idle_wait_ms));
    if (now - last_hello_check_ > own_gap) {
      for (UcxPeer* p : hellos_) p->hello_sent_at = std::max(p->hello_sent_at, now);
    }
    last_hello_check_ = now;
    std::vector<std::pair<UcxPeer*, Status>> lost;
    for (UcxPeer* p : hellos_) {
      if (now - p->hello_sent_at < bound) continue;
      if (std::optional<Status> why = OverdueVerdict(*p, now, bound)) lost.emplace_back(p, *why);
    }
    for (auto& [p, why] : lost) {
      std::erase(hellos_, p);
      OnPeerFailed(p->err_arg.peer, why);
      // A forced close ends the hello and any write queued behind the
      // wire-up with an error, so every transfer to the peer drains.
      CloseEndpoint(p->ep);
      p->ep = nullptr;
    }
  }

  // [progress] An overdue hello: nullopt keeps it waiting, else why the peer
  // is lost. A peer process alive on this host is stopped (or starved), not
  // dead — UCX's keep-alive of an answered endpoint judges it the same way
  // over shared memory — so the handshake must not be stricter: it waits,
  // and checks again every bound / 3 (UCX's keep-alive interval here), which
  // also catches the peer killed later (UCX's keep-alive skips this
  // endpoint until the answer, "Known UCX traps"). At most one /proc read
  // per overdue local peer per interval; remote peers cost none.
  std::optional<Status> OverdueVerdict(UcxPeer& p, std::chrono::steady_clock::time_point now,
                                       std::chrono::steady_clock::duration bound) {
    if (p.local) {
      if (now < p.next_liveness_check) return std::nullopt;
      switch (CheckLiveness(p.process)) {
        case Liveness::kAlive:
          p.next_liveness_check = now + bound / 3;
          handshakes_waiting_on_live_peers_++;
          if (!p.logged_waiting) {
            p.logged_waiting = true;
            spdlog::info("kvtransfer: KV peer {} has not answered the connection handshake within "
                         "transport.peer_timeout_seconds = {:g} s, but its process {} on this "
                         "host is alive (stopped?): waiting for it",
                         p.agent, options().peer_timeout_s, p.process.pid);
          }
          return std::nullopt;
        case Liveness::kExited:
          return UnavailableError(fmt::format(
              "KV peer {} (process {} on this host) exited before it answered the connection "
              "handshake; declared lost",
              p.agent, p.process.pid));
        case Liveness::kPidReused:
          return UnavailableError(fmt::format(
              "KV peer {} (process {} on this host) exited before it answered the connection "
              "handshake (pid {} now belongs to a process started later); declared lost",
              p.agent, p.process.pid, p.process.pid));
        case Liveness::kUnknown:
          break;  // /proc unreadable: judged as a remote peer
      }
    }
    return UnavailableError(fmt::format(
        "KV peer {} did not answer the connection handshake within "
        "transport.peer_timeout_seconds = {:g} s; declared lost",
        p.agent, options().peer_timeout_s));
  }

  void IssuePuts(Xfer& x, UcxPeer& peer) {
    uint64_t budget = std::min(kPutBudgetPerAdvanceBytes, 8 * options().max_put_bytes);
    while (!x.stopping && x.next_segment < x.segments.size() &&
           x.outstanding < kMaxOutstandingPerXfer && budget > 0) {
      const Segment& s = x.segments[x.next_segment];
      const uint64_t chunk =
          std::min(options().max_put_bytes, s.length_bytes - x.segment_offset_bytes);
      auto* op = new PutOp{this, &x, chunk};
      ucp_request_param_t param{};
      param.op_attr_mask =
          UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_MEMH;
      param.cb.send = &UcxTransport::OnPutDone;
      param.user_data = op;
      param.memh = memh_;
      ucs_status_ptr_t req = ucp_put_nbx(
          peer.ep, pool() + s.local_offset_bytes + x.segment_offset_bytes, chunk,
          peer.remote_base + s.remote_offset_bytes + x.segment_offset_bytes, peer.rkey, &param);
      puts_posted_++;
      if (UCS_PTR_IS_ERR(req)) {
        delete op;
        x.op_error = ucx::UcsError("ucp_put_nbx", UCS_PTR_STATUS(req));
        return;
      }
      if (req == nullptr) {  // completed in place (shared memory)
        delete op;
        x.bytes_done += chunk;
        bytes_written_ += chunk;
      } else {
        ++x.outstanding;
      }
      budget -= std::min(budget, chunk);
      x.segment_offset_bytes += chunk;
      if (x.segment_offset_bytes == s.length_bytes) {
        ++x.next_segment;
        x.segment_offset_bytes = 0;
      }
    }
  }

  void IssueFlipPut(Xfer& x, UcxPeer& peer) {
    auto* op = new PutOp{this, &x, 0};
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    param.cb.send = &UcxTransport::OnPutDone;
    param.user_data = op;
    ucs_status_ptr_t req = ucp_put_nbx(peer.ep, &x.flip_value, 1,
                                       peer.remote_base + *x.flip_remote_offset, peer.rkey, &param);
    puts_posted_++;
    if (UCS_PTR_IS_ERR(req)) {
      delete op;
      x.op_error = ucx::UcsError("ucp_put_nbx(injected fault)", UCS_PTR_STATUS(req));
    } else if (req == nullptr) {
      delete op;
    } else {
      ++x.outstanding;
    }
  }

  // Remote completion of every put before this point on the endpoint.
  void IssueFlush(Xfer& x, UcxPeer& peer) {
    x.phase = Phase::kFlush;
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    param.cb.send = &UcxTransport::OnFlushDone;
    param.user_data = &x;
    ucs_status_ptr_t req = ucp_ep_flush_nbx(peer.ep, &param);
    if (UCS_PTR_IS_ERR(req)) {
      x.op_error = ucx::UcsError("ucp_ep_flush_nbx", UCS_PTR_STATUS(req));
      x.phase = Phase::kFlushed;
      return;
    }
    if (req == nullptr) {
      x.phase = Phase::kFlushed;
    } else {
      ++x.outstanding;
    }
  }

  void SendNotice(Xfer& x, UcxPeer& peer, const detail::PeerEntry& entry) {
    x.phase = Phase::kNotice;
    x.notice_wire =
        detail::EncodeNotice(entry.desc.generation, generation(), agent_name(), *x.notice);
    ucs_status_ptr_t req =
        SendEagerAm(peer.ep, kNoticeAmId, x.notice_wire, &UcxTransport::OnNoticeSent, &x);
    if (UCS_PTR_IS_ERR(req)) {
      x.op_error = ucx::UcsError("ucp_am_send_nbx(notice)", UCS_PTR_STATUS(req));
      return;
    }
    notifications_sent_++;
    if (req == nullptr) {
      Finish(x, XferStatus::kSuccess, Status::Ok());
    } else {
      ++x.outstanding;
    }
  }

  // An active message without a header, sent eagerly (multi-fragment above
  // one fragment) so that the receiver gets it whole; `data` stays alive
  // until `done` runs.
  static ucs_status_ptr_t SendEagerAm(ucp_ep_h ep, unsigned am_id, const std::string& data,
                                      ucp_send_nbx_callback_t done, void* user_data) {
    ucp_request_param_t param{};
    param.op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = UCP_AM_SEND_FLAG_EAGER;
    param.cb.send = done;
    param.user_data = user_data;
    return ucp_am_send_nbx(ep, am_id, nullptr, 0, data.data(), data.size(), &param);
  }

  void CloseEndpoint(ucp_ep_h ep) {
    if (ep == nullptr) return;
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = UCP_EP_CLOSE_FLAG_FORCE;
    ucs_status_ptr_t req = ucp_ep_close_nbx(ep, &param);
    if (UCS_PTR_IS_ERR(req)) {
      spdlog::warn("kvtransfer: ucp_ep_close_nbx: {}", ucs_status_string(UCS_PTR_STATUS(req)));
      return;
    }
    if (req == nullptr) return;
    const auto deadline = std::chrono::steady_clock::now() + kCloseDeadline;
    while (ucp_request_check_status(req) == UCS_INPROGRESS &&
           std::chrono::steady_clock::now() < deadline) {
      ucp_worker_progress(worker_);
    }
    if (ucp_request_check_status(req) == UCS_INPROGRESS) {
      spdlog::warn("kvtransfer: endpoint close still in progress after 2 s");
      ucp_request_cancel(worker_, req);
    }
    ucp_request_free(req);
  }

  static void OnPutDone(void* request, ucs_status_t status, void* user_data) {
    auto* op = static_cast<PutOp*>(user_data);
    Xfer& x = *op->xfer;
    --x.outstanding;
    if (status == UCS_OK) {
      x.bytes_done += op->bytes;
      op->transport->bytes_written_ += op->bytes;
    } else if (x.op_error.ok()) {
      x.op_error = ucx::UcsError("put", status);
    }
    delete op;
    ucp_request_free(request);
  }

  static void OnFlushDone(void* request, ucs_status_t status, void* user_data) {
    Xfer& x = *static_cast<Xfer*>(user_data);
    --x.outstanding;
    x.phase = Phase::kFlushed;
    if (status != UCS_OK && x.op_error.ok()) x.op_error = ucx::UcsError("flush", status);
    ucp_request_free(request);
  }

  static void OnNoticeSent(void* request, ucs_status_t status, void* user_data) {
    Xfer& x = *static_cast<Xfer*>(user_data);
    --x.outstanding;
    if (status != UCS_OK && x.op_error.ok()) x.op_error = ucx::UcsError("notice send", status);
    // Finish happens in the next Advance.
    if (status == UCS_OK) x.notice_sent = true;
    ucp_request_free(request);
  }

  static ucs_status_t OnNotice(void* arg, const void* /*header*/, size_t /*header_bytes*/,
                               void* data, size_t length, const ucp_am_recv_param_t* param) {
    auto* self = static_cast<UcxTransport*>(arg);
    if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
      spdlog::warn("kvtransfer: dropping a rendezvous notice of {} bytes (notices are eager)",
                   length);
      return UCS_OK;
    }
    self->DeliverNotice(std::string_view(static_cast<const char*>(data), length));
    return UCS_OK;
  }

  static ucs_status_t OnHello(void*, const void*, size_t, void*, size_t,
                              const ucp_am_recv_param_t*) {
    return UCS_OK;  // its delivery was the point
  }

  static void OnEndpointError(void* arg, ucp_ep_h /*ep*/, ucs_status_t status) {
    auto* a = static_cast<UcxPeer::ErrArg*>(arg);
    a->transport->OnPeerFailed(a->peer, ucx::UcsError("peer endpoint failed", status));
  }

  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  ucp_mem_h memh_ = nullptr;
  int epoll_fd_ = -1;
  int wake_fd_ = -1;
  std::string descriptor_;
  std::vector<UcxPeer*> hellos_;  // [progress] peers whose hello is unanswered
  std::chrono::steady_clock::time_point last_hello_check_{};  // [progress]
};

}  // namespace

Result<std::unique_ptr<Transport>> CreateUcxTransport(const TransportOptions& options) {
  auto t = std::make_unique<UcxTransport>(options);
  TANDEM_RETURN_IF_ERROR(t->Init().WithContext("ucx transport"));
  return std::unique_ptr<Transport>(std::move(t));
}

}  // namespace tandem::kvtransfer
