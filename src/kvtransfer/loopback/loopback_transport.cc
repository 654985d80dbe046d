#include "kvtransfer/loopback/loopback_transport.h"

#include <fmt/format.h>
#include <sys/mman.h>

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>

#include "kvtransfer/transport_base.h"

namespace tandem::kvtransfer {
namespace {

using detail::Phase;
using detail::Xfer;

// The part of a loopback transport that writers touch. Writers hold a
// shared_ptr, so the struct outlives the transport; `alive` says whether the
// pool and owner still exist, and mu is held across every copy into it.
struct Endpoint {
  std::mutex mu;
  bool alive = true;
  std::atomic<uint64_t> generation{0};  // changes on a (simulated) restart
  std::byte* pool = nullptr;            // [pool_bytes]
  uint64_t pool_bytes = 0;
  detail::TransportBase* owner = nullptr;
};

struct Registry {
  std::mutex mu;
  std::map<std::string, std::weak_ptr<Endpoint>> by_name;
};
Registry& GlobalRegistry() {
  static Registry r;
  return r;
}

std::shared_ptr<Endpoint> FindEndpoint(const std::string& name) {
  Registry& r = GlobalRegistry();
  std::lock_guard lock(r.mu);
  auto it = r.by_name.find(name);
  return it == r.by_name.end() ? nullptr : it->second.lock();
}

struct LoopbackPeer : detail::PeerState {
  std::shared_ptr<Endpoint> endpoint;
  uint64_t generation = 0;  // the one the descriptor named
};

class LoopbackTransport final : public detail::TransportBase {
 public:
  explicit LoopbackTransport(const TransportOptions& options) : TransportBase(options) {}

  Status Init() {
    void* mem =
        mmap(nullptr, local_bytes(), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mem == MAP_FAILED) {
      return ResourceExhaustedError(
          fmt::format("loopback: cannot map a KV pool of {} bytes", pool_bytes()));
    }
    set_pool(static_cast<std::byte*>(mem));
    endpoint_ = std::make_shared<Endpoint>();
    endpoint_->generation = generation();
    endpoint_->pool = pool();
    endpoint_->pool_bytes = pool_bytes();
    endpoint_->owner = this;
    {
      Registry& r = GlobalRegistry();
      std::lock_guard lock(r.mu);
      if (auto old = r.by_name[agent_name()].lock(); old) {
        std::lock_guard elock(old->mu);
        if (old->alive) {
          return AlreadyExistsError(
              fmt::format("loopback: agent '{}' already exists in this process", agent_name()));
        }
      }
      r.by_name[agent_name()] = endpoint_;
    }
    StartProgressThread();
    return Status::Ok();
  }

  ~LoopbackTransport() override {
    Shutdown();
    if (endpoint_) {
      std::lock_guard lock(endpoint_->mu);  // waits for a writer's copy in progress
      endpoint_->alive = false;
      endpoint_->owner = nullptr;
    }
    if (pool() != nullptr) munmap(pool(), local_bytes());
  }

  Capabilities capabilities() const override {
    Capabilities c;
    c.backend = "loopback";
    c.cross_process = false;
    c.max_notification_bytes = kTransportNoticeBytes;  // as UCX's
    return c;
  }

  std::string LocalDescriptor() const override {
    PeerDescriptor d;
    d.backend = "loopback";
    d.agent_name = agent_name();
    d.generation = endpoint_->generation.load();
    d.block_bytes = block_bytes();
    d.num_blocks = num_blocks();
    d.remote_base = reinterpret_cast<uint64_t>(pool());
    d.process = LocalProcessIdentity();  // the same descriptor format as ucx's
    return SerializeDescriptor(d);
  }

 protected:
  Result<std::unique_ptr<detail::PeerState>> ConnectPeer(PeerId,
                                                         const PeerDescriptor& desc) override {
    auto ep = FindEndpoint(desc.agent_name);
    if (!ep) return UnavailableError(fmt::format("loopback: no live agent '{}'", desc.agent_name));
    {
      std::lock_guard lock(ep->mu);
      if (!ep->alive)
        return UnavailableError(fmt::format("loopback: agent '{}' is gone", desc.agent_name));
      if (ep->generation != desc.generation || ep->pool_bytes != desc.pool_bytes()) {
        return FailedPreconditionError(fmt::format(
            "stale descriptor: loopback agent '{}' is at generation {}, descriptor says {}",
            desc.agent_name, ep->generation.load(), desc.generation));
      }
    }
    auto p = std::make_unique<LoopbackPeer>();
    p->endpoint = std::move(ep);
    p->generation = desc.generation;
    live_remote_keys_++;
    return std::unique_ptr<detail::PeerState>(std::move(p));
  }

  void DisconnectPeer(detail::PeerState& state) override {
    static_cast<LoopbackPeer&>(state).endpoint.reset();
    live_remote_keys_--;
  }

  // With `lock` on ep.mu: true when the peer is alive at the generation the
  // transfer was prepared for. Otherwise releases the lock, fails the peer
  // or the transfer, and returns false.
  bool EndpointUsable(std::unique_lock<std::mutex>& lock, Endpoint& ep, const LoopbackPeer& peer,
                      Xfer& x, detail::PeerEntry& entry) {
    if (!ep.alive) {
      lock.unlock();
      OnPeerFailed(entry.id, UnavailableError(fmt::format("loopback peer '{}' is gone",
                                                          entry.desc.agent_name)));
      return false;
    }
    if (ep.generation != peer.generation) {
      lock.unlock();
      Finish(x, XferStatus::kErrStaleDescriptor, StaleError(entry, ep));
      return false;
    }
    return true;
  }

  // One put (or the notice) per call, so that aborts, peer loss and other
  // transfers interleave with large writes.
  void Advance(Xfer& x, detail::PeerEntry& entry) override {
    auto& peer = static_cast<LoopbackPeer&>(*entry.state);
    if (x.abort.load() && (!x.fault_in_flight || x.next_segment == x.segments.size())) {
      x.stopping = true;
    }
    if (x.phase == Phase::kPut) {
      if (!x.stopping && x.next_segment < x.segments.size()) {
        const Segment& s = x.segments[x.next_segment];
        const uint64_t chunk =
            std::min(options().max_put_bytes, s.length_bytes - x.segment_offset_bytes);
        if (options().loopback_delay_per_put_us > 0) {
          std::this_thread::sleep_for(
              std::chrono::microseconds(options().loopback_delay_per_put_us));
        }
        Endpoint& ep = *peer.endpoint;
        {
          std::unique_lock lock(ep.mu);
          if (!EndpointUsable(lock, ep, peer, x, entry)) return;
          std::memcpy(ep.pool + s.remote_offset_bytes + x.segment_offset_bytes,
                      pool() + s.local_offset_bytes + x.segment_offset_bytes, chunk);
        }
        puts_posted_++;
        bytes_written_ += chunk;
        x.bytes_done += chunk;
        x.segment_offset_bytes += chunk;
        if (x.segment_offset_bytes == s.length_bytes) {
          ++x.next_segment;
          x.segment_offset_bytes = 0;
        }
        return;
      }
      x.phase = Phase::kFlushed;  // memcpy under the endpoint lock is already visible
    }
    if (x.phase != Phase::kFlushed) return;
    if (x.stopping) {
      Finish(x, XferStatus::kErrCanceled,
             CancelledError(
                 fmt::format("aborted after {} of {} bytes", x.bytes_done.load(), x.total_bytes)));
      return;
    }
    if (x.flip_remote_offset && !x.flip_done) {  // fault injection: after the data
      x.flip_done = true;
      Endpoint& ep = *peer.endpoint;
      std::unique_lock lock(ep.mu);
      if (!EndpointUsable(lock, ep, peer, x, entry)) return;
      ep.pool[*x.flip_remote_offset] = x.flip_value;
    }
    if (x.notice) {
      Endpoint& ep = *peer.endpoint;
      std::unique_lock lock(ep.mu);
      if (!EndpointUsable(lock, ep, peer, x, entry)) return;
      ep.owner->DeliverNotice(
          detail::EncodeNotice(ep.generation.load(), generation(), agent_name(), *x.notice));
      notifications_sent_++;
    }
    Finish(x, XferStatus::kSuccess, Status::Ok());
  }

  bool ProgressOnce() override { return false; }

  uint64_t CurrentGeneration() const override { return endpoint_->generation.load(); }

  void WaitForEvents(int timeout_ms) override {
    std::unique_lock lock(wake_mu_);
    if (timeout_ms < 0) {
      wake_cv_.wait(lock, [&] { return woken_; });
    } else {
      wake_cv_.wait_for(lock, std::chrono::milliseconds(timeout_ms), [&] { return woken_; });
    }
    woken_ = false;
  }

  void Wake() override {
    {
      std::lock_guard lock(wake_mu_);
      woken_ = true;
    }
    wake_cv_.notify_one();
  }

  Result<std::string> DescribePeerTransports(detail::PeerState&) override {
    return std::string("loopback/memcpy");
  }

 private:
  static Status StaleError(const detail::PeerEntry& entry, const Endpoint& ep) {
    return FailedPreconditionError(
        fmt::format("stale descriptor: loopback agent '{}' restarted (generation {} -> {})",
                    entry.desc.agent_name, entry.desc.generation, ep.generation.load()));
  }

  std::shared_ptr<Endpoint> endpoint_;
  std::mutex wake_mu_;
  std::condition_variable wake_cv_;
  bool woken_ = false;
};

}  // namespace

Result<std::unique_ptr<Transport>> CreateLoopbackTransport(const TransportOptions& options) {
  auto t = std::make_unique<LoopbackTransport>(options);
  TANDEM_RETURN_IF_ERROR(t->Init());
  return std::unique_ptr<Transport>(std::move(t));
}

Status LoopbackDropPeer(const std::string& agent_name) {
  auto ep = FindEndpoint(agent_name);
  if (!ep) return NotFoundError(fmt::format("loopback: no agent '{}'", agent_name));
  std::lock_guard lock(ep->mu);
  ep->alive = false;
  return Status::Ok();
}

Result<uint64_t> LoopbackRestartPeer(const std::string& agent_name) {
  auto ep = FindEndpoint(agent_name);
  if (!ep) return NotFoundError(fmt::format("loopback: no agent '{}'", agent_name));
  std::lock_guard lock(ep->mu);
  const uint64_t g = NewGeneration();
  ep->generation.store(g);
  return g;
}

}  // namespace tandem::kvtransfer
