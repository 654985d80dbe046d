#include "parallel/shm_communicator.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstring>
#include <new>
#include <thread>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace tandem::parallel {

enum class ShmCommunicator::Op : uint32_t {
  kNone = 0,
  kAllReduce = 1,
  kAllGather = 2,
  kBroadcast = 3,
  kBarrier = 4
};

namespace {

constexpr uint64_t kMagic = 0x314d4f4353444e54ull;  // "TNDSCOM1"
constexpr uint32_t kVersion = 1;
constexpr int kMaxRanks = 64;
constexpr size_t kMinMaxBytes = 64;
constexpr size_t kMaxMaxBytes = size_t{1} << 30;
// Waiting: spin this long before sleeping on the futex (a peer on another
// core usually posts within microseconds; on an oversubscribed machine the
// peer needs this core, so the spin stays short).
constexpr auto kSpin = std::chrono::microseconds(20);
// Futex sleep between two checks of the group's health.
constexpr int64_t kSliceNs = 20'000'000;
// A segment whose creator has not initialised it within this long is stale.
constexpr auto kInitWait = std::chrono::seconds(2);

constexpr size_t RoundUp(size_t n, size_t a) { return (n + a - 1) / a * a; }

const char* OpName(uint32_t op) {
  switch (op) {
    case 1: return "AllReduceSum";
    case 2: return "AllGather";
    case 3: return "Broadcast";
    case 4: return "Barrier";
    default: return "nothing";
  }
}

enum SlotState : uint32_t { kEmpty = 0, kJoined = 1, kLeft = 2 };

struct OpDesc {  // written before `posted` is released, read after acquiring it
  uint32_t op;
  int32_t root;
  uint64_t call_bytes;
};

struct alignas(64) Header {
  std::atomic<uint64_t> magic;
  uint32_t version;
  uint32_t size;
  uint64_t max_bytes;
  uint64_t total_bytes;
  alignas(64) std::atomic<uint32_t> joined;  // futex word: ranks joined
  std::atomic<uint32_t> joined_waiters;
  std::atomic<int32_t> broken;  // 0, or 1 + the first rank found dead
};

struct alignas(64) Slot {
  std::atomic<int32_t> pid;
  std::atomic<uint32_t> state;
  std::atomic<uint32_t> arrived;  // set at the claim, never cleared (join-timeout messages)
  alignas(64) std::atomic<uint32_t> posted;  // futex word: collective chunks entered
  std::atomic<uint32_t> waiters;
  OpDesc desc[2];  // by chunk parity
};

struct alignas(64) Channel {  // one ordered pair (src -> dst)
  std::atomic<uint32_t> sent;  // futex word: chunks written by src
  std::atomic<uint32_t> sent_waiters;
  uint64_t chunk_bytes;
  uint64_t message_bytes;
  alignas(64) std::atomic<uint32_t> acked;  // futex word: chunks consumed by dst
  std::atomic<uint32_t> acked_waiters;
};

static_assert(std::atomic<uint32_t>::is_always_lock_free);
static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t));

long Futex(const void* word, int op, uint32_t val, const timespec* timeout) {
  return syscall(SYS_futex, word, op, val, timeout, nullptr, 0);
}

void Wake(std::atomic<uint32_t>& word, std::atomic<uint32_t>& waiters) {
  if (waiters.load(std::memory_order_seq_cst) > 0) Futex(&word, FUTEX_WAKE, INT_MAX, nullptr);
}

void Publish(std::atomic<uint32_t>& word, std::atomic<uint32_t>& waiters, uint32_t value) {
  word.store(value, std::memory_order_seq_cst);
  Wake(word, waiters);
}

bool Reached(uint32_t value, uint32_t target) {
  return static_cast<int32_t>(value - target) >= 0;
}

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#endif
}

// Whether `pid` has exited: no such process, or a zombie not yet reaped
// (kill(pid, 0) still succeeds on a zombie).
bool ProcessGone(int32_t pid) {
  if (kill(pid, 0) != 0) return errno == ESRCH;
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", static_cast<int>(pid));
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return false;
  char buf[512];
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  // "pid (comm) S ...": the state follows the last ')'.
  const char* close_paren = std::strrchr(buf, ')');
  return close_paren != nullptr && close_paren[1] == ' ' &&
         (close_paren[2] == 'Z' || close_paren[2] == 'X');
}

std::string Errno(std::string_view what) {
  return std::string(what) + ": " + std::strerror(errno);
}

}  // namespace

// Offsets of the parts of the segment (the same arithmetic on every rank).
struct ShmCommunicator::Layout {
  size_t slots, channels, data, buf_bytes, total;
  Layout(int size, size_t max_bytes) {
    slots = RoundUp(sizeof(Header), 64);
    channels = slots + sizeof(Slot) * size;
    data = RoundUp(channels + sizeof(Channel) * size * size, 4096);
    buf_bytes = RoundUp(max_bytes, 64);
    // Two collective buffers per rank, one per ordered pair (src != dst).
    total = data + buf_bytes * (2 * size + size * (size - 1));
  }
};

namespace {
Header& Hdr(std::byte* base) { return *reinterpret_cast<Header*>(base); }
Slot& SlotOf(std::byte* base, int r) {
  return reinterpret_cast<Slot*>(base + RoundUp(sizeof(Header), 64))[r];
}
Channel& ChannelOf(std::byte* base, int size, int src, int dst) {
  auto* channels = reinterpret_cast<Channel*>(base + RoundUp(sizeof(Header), 64) +
                                              sizeof(Slot) * size);
  return channels[src * size + dst];
}
}  // namespace

std::string ShmCommunicator::SegmentName(const std::string& group) {
  std::string name = "/tandem-comm.";
  for (char c : group) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == '-';
    name += ok ? c : '_';
  }
  return name;
}

void ShmCommunicator::TreeSum(const float* const* src, int n, float* out, size_t count) {
  if (n <= 0) return;
  if (n == 1) {
    if (out != src[0]) std::memmove(out, src[0], count * sizeof(float));
    return;
  }
  if (n == 2) {
    const float* a = src[0];
    const float* b = src[1];
    for (size_t i = 0; i < count; ++i) out[i] = a[i] + b[i];
    return;
  }
  if (n == 4) {
    const float* a = src[0];
    const float* b = src[1];
    const float* c = src[2];
    const float* d = src[3];
    for (size_t i = 0; i < count; ++i) out[i] = (a[i] + b[i]) + (c[i] + d[i]);
    return;
  }
  // General n: the left subtree takes the largest power of two below n
  // (size 8: 4 + 4; size 6: 4 + 2; size 3: 2 + 1), blockwise.
  int left = 1;
  while (left * 2 < n) left *= 2;
  constexpr size_t kBlock = 1024;
  float right[kBlock];
  const float* lp[kMaxRanks];
  const float* rp[kMaxRanks];
  for (size_t off = 0; off < count; off += kBlock) {
    const size_t len = std::min(kBlock, count - off);
    for (int k = 0; k < n; ++k) (k < left ? lp[k] : rp[k - left]) = src[k] + off;
    TreeSum(lp, left, out + off, len);
    TreeSum(rp, n - left, right, len);
    for (size_t i = 0; i < len; ++i) out[off + i] += right[i];
  }
}

Result<std::unique_ptr<ShmCommunicator>> ShmCommunicator::Join(const std::string& group,
                                                                int rank, int size,
                                                                int64_t join_timeout_ms,
                                                                size_t max_bytes) {
  if (group.empty() || group.size() > 200) {
    return InvalidArgumentError("shm communicator: group name must have 1..200 characters, got " +
                                std::to_string(group.size()));
  }
  if (size < 1 || size > kMaxRanks) {
    return InvalidArgumentError("shm communicator: size " + std::to_string(size) +
                                " is outside 1.." + std::to_string(kMaxRanks));
  }
  if (rank < 0 || rank >= size) {
    return InvalidArgumentError("shm communicator: rank " + std::to_string(rank) +
                                " is outside 0.." + std::to_string(size - 1));
  }
  if (max_bytes < kMinMaxBytes || max_bytes > kMaxMaxBytes) {
    return InvalidArgumentError("shm communicator: max_bytes " + std::to_string(max_bytes) +
                                " is outside " + std::to_string(kMinMaxBytes) + ".." +
                                std::to_string(kMaxMaxBytes));
  }
  const Layout layout(size, max_bytes);
  const std::string name = SegmentName(group);
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::milliseconds(std::max<int64_t>(join_timeout_ms, 0));
  const int32_t self_pid = getpid();

  std::byte* base = nullptr;
  size_t total = 0;
  // Unlinks `name` only while it still names the segment behind `fd` (a
  // newer group of the same name is left alone).
  auto unlink_if_same = [&name](int fd) {
    struct stat mine, current;
    if (fstat(fd, &mine) != 0) return;
    const std::string path = "/dev/shm" + name;
    if (stat(path.c_str(), &current) == 0 && current.st_ino == mine.st_ino &&
        current.st_dev == mine.st_dev) {
      shm_unlink(name.c_str());
    }
  };

  for (int attempt = 0; base == nullptr; ++attempt) {
    if (attempt > 8) {
      return UnavailableError("shm communicator: group " + group +
                              ": could not create or attach segment " + name);
    }
    int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd >= 0) {  // the creator
      struct statvfs vfs;
      if (fstatvfs(fd, &vfs) == 0 &&
          static_cast<unsigned long long>(vfs.f_bavail) * vfs.f_frsize < layout.total) {
        close(fd);
        shm_unlink(name.c_str());
        return ResourceExhaustedError(
            "shm communicator: group " + group + " needs " + std::to_string(layout.total) +
            " bytes of /dev/shm (" + std::to_string(size) + " ranks, max_bytes " +
            std::to_string(max_bytes) + "), only " +
            std::to_string(static_cast<unsigned long long>(vfs.f_bavail) * vfs.f_frsize) +
            " are free: lower max_bytes or enlarge /dev/shm");
      }
      if (ftruncate(fd, static_cast<off_t>(layout.total)) != 0) {
        const Status s = UnavailableError(Errno("shm communicator: ftruncate " + name));
        close(fd);
        shm_unlink(name.c_str());
        return s;
      }
      void* p = mmap(nullptr, layout.total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      if (p == MAP_FAILED) {
        const Status s = UnavailableError(Errno("shm communicator: mmap " + name));
        close(fd);
        shm_unlink(name.c_str());
        return s;
      }
      close(fd);
      base = static_cast<std::byte*>(p);
      total = layout.total;
      // ftruncate gave zeroed pages; construct the shared objects in place.
      Header* h = new (base) Header();
      h->version = kVersion;
      h->size = static_cast<uint32_t>(size);
      h->max_bytes = max_bytes;
      h->total_bytes = layout.total;
      for (int r = 0; r < size; ++r) new (&SlotOf(base, r)) Slot();
      for (int s = 0; s < size; ++s) {
        for (int d = 0; d < size; ++d) new (&ChannelOf(base, size, s, d)) Channel();
      }
      h->magic.store(kMagic, std::memory_order_release);
      break;
    }
    if (errno != EEXIST) {
      return UnavailableError(Errno("shm communicator: shm_open " + name));
    }
    fd = shm_open(name.c_str(), O_RDWR, 0600);
    if (fd < 0) {
      if (errno == ENOENT) continue;  // unlinked meanwhile: try to create it
      return UnavailableError(Errno("shm communicator: shm_open " + name));
    }
    // Wait for the creator to size and initialise it.
    const auto init_deadline = std::chrono::steady_clock::now() + kInitWait;
    struct stat st{};
    bool ready = false;
    void* p = MAP_FAILED;
    while (std::chrono::steady_clock::now() < init_deadline) {
      if (fstat(fd, &st) == 0 && static_cast<size_t>(st.st_size) >= sizeof(Header)) {
        if (p == MAP_FAILED) {
          p = mmap(nullptr, st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
          if (p == MAP_FAILED) break;
        }
        if (Hdr(static_cast<std::byte*>(p)).magic.load(std::memory_order_acquire) == kMagic) {
          ready = true;
          break;
        }
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (!ready) {  // the creator died before initialising it: stale
      if (p != MAP_FAILED) munmap(p, st.st_size);
      unlink_if_same(fd);
      close(fd);
      continue;
    }
    std::byte* b = static_cast<std::byte*>(p);
    Header& h = Hdr(b);
    if (h.version != kVersion || h.total_bytes != static_cast<uint64_t>(st.st_size)) {
      munmap(p, st.st_size);
      unlink_if_same(fd);
      close(fd);
      continue;
    }
    // A member that died (still marked joined, process gone) makes the
    // segment stale: a crashed earlier run of the same group name.
    bool stale = false;
    for (uint32_t r = 0; r < h.size; ++r) {
      const int32_t pid = SlotOf(b, static_cast<int>(r)).pid.load();
      if (pid != 0 && pid != self_pid && ProcessGone(pid)) stale = true;
    }
    if (stale) {
      munmap(p, st.st_size);
      unlink_if_same(fd);
      close(fd);
      continue;
    }
    if (h.size != static_cast<uint32_t>(size) || h.max_bytes != max_bytes) {
      const Status s = InvalidArgumentError(
          "shm communicator: group " + group + " exists with size " + std::to_string(h.size) +
          " and max_bytes " + std::to_string(h.max_bytes) + "; rank " + std::to_string(rank) +
          " asked for size " + std::to_string(size) + " and max_bytes " +
          std::to_string(max_bytes));
      munmap(p, st.st_size);
      close(fd);
      return s;
    }
    close(fd);
    base = b;
    total = st.st_size;
  }

  // Claim the slot.
  Header& h = Hdr(base);
  Slot& mine = SlotOf(base, rank);
  int32_t expected = 0;
  if (!mine.pid.compare_exchange_strong(expected, self_pid)) {
    munmap(base, total);
    return AlreadyExistsError("shm communicator: rank " + std::to_string(rank) + " of group " +
                              group + " is already held by pid " + std::to_string(expected));
  }
  mine.state.store(kJoined);
  mine.arrived.store(1);
  const uint32_t now_joined = h.joined.fetch_add(1) + 1;
  Wake(h.joined, h.joined_waiters);
  if (now_joined == static_cast<uint32_t>(size)) shm_unlink(name.c_str());

  // Wait for everyone (the futex wakes at every join; 20 ms slices to
  // notice the deadline).
  while (true) {
    uint32_t j = h.joined.load();
    if (j >= static_cast<uint32_t>(size)) break;
    if (std::chrono::steady_clock::now() >= deadline) {
      // Leave, unless the last rank joined just now (then the group formed).
      if (!h.joined.compare_exchange_strong(j, j - 1)) continue;
      std::string missing;
      for (int r = 0; r < size; ++r) {
        if (r != rank && SlotOf(base, r).arrived.load() == 0) {
          missing += (missing.empty() ? "" : ", ") + std::to_string(r);
        }
      }
      mine.state.store(kEmpty);
      mine.pid.store(0);
      if (j - 1 == 0) shm_unlink(name.c_str());
      munmap(base, total);
      return DeadlineExceededError("shm communicator: group " + group + ": rank(s) " + missing +
                                   " of " + std::to_string(size) + " did not join within " +
                                   std::to_string(join_timeout_ms) +
                                   " ms (the ranks of a group must run on this host: they "
                                   "meet in /dev/shm" + name + ")");
    }
    h.joined_waiters.fetch_add(1);
    if (h.joined.load() == j) {
      timespec ts{0, kSliceNs};
      Futex(&h.joined, FUTEX_WAIT, j, &ts);
    }
    h.joined_waiters.fetch_sub(1);
  }

  auto comm = std::unique_ptr<ShmCommunicator>(new ShmCommunicator());
  comm->group_ = group;
  comm->name_ = name;
  comm->rank_ = rank;
  comm->size_ = size;
  comm->max_bytes_ = max_bytes;
  comm->buf_bytes_ = layout.buf_bytes;
  comm->base_ = base;
  comm->total_bytes_ = total;
  comm->pidfds_.assign(size, -1);
  comm->pids_.assign(size, 0);
  for (int r = 0; r < size; ++r) {
    const int32_t pid = SlotOf(base, r).pid.load();
    comm->pids_[r] = pid;
    if (r == rank || pid == self_pid) continue;  // a thread of this process
    // glibc 2.36 declares pidfd_open without C linkage: the raw syscall.
    const int fd = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
    if (fd >= 0) {
      comm->pidfds_[r] = fd;
    } else if (errno == ESRCH) {
      comm->failed_ = UnavailableError("shm communicator: group " + group + ": rank " +
                                       std::to_string(r) + " (pid " + std::to_string(pid) +
                                       ") died while the group formed");
    } else {
      return UnavailableError(Errno("shm communicator: pidfd_open of rank " +
                                    std::to_string(r) + " (pid " + std::to_string(pid) + ")"));
    }
  }
  return comm;
}

ShmCommunicator::~ShmCommunicator() {
  if (base_ == nullptr) return;
  Slot& mine = SlotOf(base_, rank_);
  mine.state.store(kLeft);
  // Wake whoever sleeps on this rank's words: they re-check and see it left.
  Futex(&mine.posted, FUTEX_WAKE, INT_MAX, nullptr);
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    Futex(&ChannelOf(base_, size_, rank_, r).sent, FUTEX_WAKE, INT_MAX, nullptr);
    Futex(&ChannelOf(base_, size_, r, rank_).acked, FUTEX_WAKE, INT_MAX, nullptr);
  }
  for (int fd : pidfds_) {
    if (fd >= 0) close(fd);
  }
  munmap(base_, total_bytes_);
}

Status ShmCommunicator::Fail(Status status) {
  if (failed_.ok()) failed_ = std::move(status);
  return failed_;
}

Status ShmCommunicator::CheckBroken() {
  if (!failed_.ok()) return failed_;
  const int32_t broken = Hdr(base_).broken.load(std::memory_order_relaxed);
  if (broken != 0) {
    const int r = broken - 1;
    return Fail(UnavailableError("shm communicator: group " + group_ + ": rank " +
                                 std::to_string(r) + " (pid " + std::to_string(pids_[r]) +
                                 ") died"));
  }
  return Status::Ok();
}

Status ShmCommunicator::CheckPeers() {
  if (!failed_.ok()) return failed_;
  Header& h = Hdr(base_);
  // A peer whose process exited while still a member (not left in order).
  std::vector<pollfd> fds;
  std::vector<int> ranks;
  for (int r = 0; r < size_; ++r) {
    if (pidfds_[r] >= 0) {
      fds.push_back({pidfds_[r], POLLIN, 0});
      ranks.push_back(r);
    }
  }
  if (!fds.empty() && poll(fds.data(), fds.size(), 0) > 0) {
    for (size_t i = 0; i < fds.size(); ++i) {
      if (fds[i].revents == 0) continue;
      const int r = ranks[i];
      if (SlotOf(base_, r).state.load() == kLeft) continue;  // exited after leaving in order
      int32_t none = 0;
      h.broken.compare_exchange_strong(none, r + 1);
    }
  }
  return CheckBroken();
}

Status ShmCommunicator::CheckGroup(int peer) {
  TANDEM_RETURN_IF_ERROR(CheckPeers());
  if (peer >= 0 && SlotOf(base_, peer).state.load() == kLeft) {
    return Fail(UnavailableError("shm communicator: group " + group_ + ": rank " +
                                 std::to_string(peer) + " (pid " + std::to_string(pids_[peer]) +
                                 ") left the group"));
  }
  return Status::Ok();
}

Status ShmCommunicator::WaitUntil(std::atomic<uint32_t>& word, std::atomic<uint32_t>& waiters,
                                  uint32_t target, int peer) {
  if (Reached(word.load(std::memory_order_acquire), target)) return Status::Ok();
  const auto spin_until = std::chrono::steady_clock::now() + kSpin;
  for (int i = 0;; ++i) {
    if (Reached(word.load(std::memory_order_acquire), target)) return Status::Ok();
    CpuRelax();
    if ((i & 63) == 63 && std::chrono::steady_clock::now() >= spin_until) break;
  }
  while (true) {
    waiters.fetch_add(1, std::memory_order_seq_cst);
    const uint32_t v = word.load(std::memory_order_seq_cst);
    if (!Reached(v, target)) {
      timespec ts{0, kSliceNs};
      Futex(&word, FUTEX_WAIT, v, &ts);
    }
    waiters.fetch_sub(1, std::memory_order_seq_cst);
    if (Reached(word.load(std::memory_order_acquire), target)) return Status::Ok();
    TANDEM_RETURN_IF_ERROR(CheckGroup(peer));
  }
}

std::byte* ShmCommunicator::Buffer(int r, uint32_t seq) const {
  const Layout layout(size_, max_bytes_);
  return base_ + layout.data + buf_bytes_ * (2 * r + (seq & 1));
}

Status ShmCommunicator::Post(Op op, int root, uint64_t call_bytes,
                             std::span<const std::byte> payload) {
  const uint32_t s = seq_ + 1;
  // Buffer parity s % 2 was last read in chunk s - 2; every rank that entered
  // chunk s - 1 has finished it.
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    Slot& peer = SlotOf(base_, r);
    TANDEM_RETURN_IF_ERROR(WaitUntil(peer.posted, peer.waiters, s - 1, r));
  }
  Slot& mine = SlotOf(base_, rank_);
  if (!payload.empty()) std::memcpy(Buffer(rank_, s), payload.data(), payload.size());
  mine.desc[s & 1] = OpDesc{static_cast<uint32_t>(op), root, call_bytes};
  seq_ = s;
  Publish(mine.posted, mine.waiters, s);
  return Status::Ok();
}

Status ShmCommunicator::WaitPeer(int r, Op op, int root, uint64_t call_bytes) {
  Slot& peer = SlotOf(base_, r);
  TANDEM_RETURN_IF_ERROR(WaitUntil(peer.posted, peer.waiters, seq_, r));
  const OpDesc& d = peer.desc[seq_ & 1];
  if (d.op != static_cast<uint32_t>(op) || d.root != root || d.call_bytes != call_bytes) {
    return Fail(InternalError(
        "shm communicator: group " + group_ + ": rank " + std::to_string(rank_) + " called " +
        OpName(static_cast<uint32_t>(op)) + "(" + std::to_string(call_bytes) + " bytes" +
        (op == Op::kBroadcast ? ", root " + std::to_string(root) : std::string()) +
        ") while rank " + std::to_string(r) + " called " + OpName(d.op) + "(" +
        std::to_string(d.call_bytes) + " bytes" +
        (d.op == static_cast<uint32_t>(Op::kBroadcast) ? ", root " + std::to_string(d.root)
                                                       : std::string()) +
        ")"));
  }
  return Status::Ok();
}

Status ShmCommunicator::AllReduceSum(std::span<float> data) {
  TANDEM_RETURN_IF_ERROR(CheckBroken());
  if (size_ == 1) return Status::Ok();
  const uint64_t call_bytes = data.size_bytes();
  const size_t chunk = max_bytes_ / sizeof(float);
  const float* src[kMaxRanks];
  for (size_t off = 0; off < data.size(); off += chunk) {
    const size_t n = std::min(chunk, data.size() - off);
    TANDEM_RETURN_IF_ERROR(
        Post(Op::kAllReduce, -1, call_bytes, std::as_bytes(data.subspan(off, n))));
    for (int r = 0; r < size_; ++r) {
      if (r != rank_) TANDEM_RETURN_IF_ERROR(WaitPeer(r, Op::kAllReduce, -1, call_bytes));
      src[r] = reinterpret_cast<const float*>(Buffer(r, seq_));
    }
    TreeSum(src, size_, data.data() + off, n);
  }
  return Status::Ok();
}

Status ShmCommunicator::AllGather(std::span<const float> in, std::span<float> out) {
  TANDEM_RETURN_IF_ERROR(CheckBroken());
  if (out.size() != in.size() * static_cast<size_t>(size_)) {
    return InvalidArgumentError("shm communicator: AllGather output has " +
                                std::to_string(out.size()) + " floats; " +
                                std::to_string(size_) + " ranks x " +
                                std::to_string(in.size()) + " need " +
                                std::to_string(in.size() * size_));
  }
  if (!in.empty()) std::memcpy(out.data() + rank_ * in.size(), in.data(), in.size_bytes());
  if (size_ == 1) return Status::Ok();
  const uint64_t call_bytes = in.size_bytes();
  const size_t chunk = max_bytes_ / sizeof(float);
  for (size_t off = 0; off < in.size(); off += chunk) {
    const size_t n = std::min(chunk, in.size() - off);
    TANDEM_RETURN_IF_ERROR(Post(Op::kAllGather, -1, call_bytes, std::as_bytes(in.subspan(off, n))));
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      TANDEM_RETURN_IF_ERROR(WaitPeer(r, Op::kAllGather, -1, call_bytes));
      std::memcpy(out.data() + r * in.size() + off, Buffer(r, seq_), n * sizeof(float));
    }
  }
  return Status::Ok();
}

Status ShmCommunicator::Broadcast(std::span<std::byte> data, int root) {
  TANDEM_RETURN_IF_ERROR(CheckBroken());
  if (root < 0 || root >= size_) {
    return InvalidArgumentError("shm communicator: Broadcast root " + std::to_string(root) +
                                " is outside 0.." + std::to_string(size_ - 1));
  }
  if (size_ == 1) return Status::Ok();
  const uint64_t call_bytes = data.size();
  for (size_t off = 0; off < data.size(); off += max_bytes_) {
    const size_t n = std::min(max_bytes_, data.size() - off);
    if (rank_ == root) {
      TANDEM_RETURN_IF_ERROR(Post(Op::kBroadcast, root, call_bytes, data.subspan(off, n)));
    } else {
      TANDEM_RETURN_IF_ERROR(Post(Op::kBroadcast, root, call_bytes, {}));
      TANDEM_RETURN_IF_ERROR(WaitPeer(root, Op::kBroadcast, root, call_bytes));
      std::memcpy(data.data() + off, Buffer(root, seq_), n);
    }
  }
  return Status::Ok();
}

Status ShmCommunicator::Barrier() {
  TANDEM_RETURN_IF_ERROR(CheckBroken());
  if (size_ == 1) return Status::Ok();
  TANDEM_RETURN_IF_ERROR(Post(Op::kBarrier, -1, 0, {}));
  for (int r = 0; r < size_; ++r) {
    if (r != rank_) TANDEM_RETURN_IF_ERROR(WaitPeer(r, Op::kBarrier, -1, 0));
  }
  return Status::Ok();
}

Status ShmCommunicator::Send(std::span<const std::byte> data, int dst) {
  TANDEM_RETURN_IF_ERROR(CheckBroken());
  if (dst < 0 || dst >= size_ || dst == rank_) {
    return InvalidArgumentError("shm communicator: Send to rank " + std::to_string(dst) +
                                " from rank " + std::to_string(rank_) + " of " +
                                std::to_string(size_) + " (must be another rank)");
  }
  Channel& ch = ChannelOf(base_, size_, rank_, dst);
  const Layout layout(size_, max_bytes_);
  const int pair = rank_ * (size_ - 1) + (dst < rank_ ? dst : dst - 1);
  std::byte* buf = base_ + layout.data + buf_bytes_ * (2 * size_ + pair);
  // A zero-byte message still travels as one chunk (Recv waits for it).
  size_t off = 0;
  do {
    const size_t n = std::min(max_bytes_, data.size() - off);
    const uint32_t sent = ch.sent.load(std::memory_order_relaxed);
    // The single buffer is free once dst consumed every earlier chunk.
    TANDEM_RETURN_IF_ERROR(WaitUntil(ch.acked, ch.acked_waiters, sent, dst));
    if (n > 0) std::memcpy(buf, data.data() + off, n);
    ch.chunk_bytes = n;
    ch.message_bytes = data.size();
    Publish(ch.sent, ch.sent_waiters, sent + 1);
    off += n;
  } while (off < data.size());
  return Status::Ok();
}

Status ShmCommunicator::Recv(std::span<std::byte> data, int src) {
  TANDEM_RETURN_IF_ERROR(CheckBroken());
  if (src < 0 || src >= size_ || src == rank_) {
    return InvalidArgumentError("shm communicator: Recv from rank " + std::to_string(src) +
                                " at rank " + std::to_string(rank_) + " of " +
                                std::to_string(size_) + " (must be another rank)");
  }
  Channel& ch = ChannelOf(base_, size_, src, rank_);
  const Layout layout(size_, max_bytes_);
  const int pair = src * (size_ - 1) + (rank_ < src ? rank_ : rank_ - 1);
  const std::byte* buf = base_ + layout.data + buf_bytes_ * (2 * size_ + pair);
  size_t off = 0;
  do {
    const uint32_t acked = ch.acked.load(std::memory_order_relaxed);
    TANDEM_RETURN_IF_ERROR(WaitUntil(ch.sent, ch.sent_waiters, acked + 1, src));
    const size_t n = ch.chunk_bytes;
    if (ch.message_bytes != data.size() || off + n > data.size()) {
      return Fail(InternalError("shm communicator: group " + group_ + ": rank " +
                                std::to_string(rank_) + " receives " +
                                std::to_string(data.size()) + " bytes from rank " +
                                std::to_string(src) + ", which sent " +
                                std::to_string(ch.message_bytes)));
    }
    if (n > 0) std::memcpy(data.data() + off, buf, n);
    Publish(ch.acked, ch.acked_waiters, acked + 1);
    off += n;
  } while (off < data.size());
  return Status::Ok();
}

Result<std::unique_ptr<Communicator>> CreateShmCommunicator(const std::string& group, int rank,
                                                            int size, int64_t join_timeout_ms,
                                                            size_t max_bytes) {
  auto comm = ShmCommunicator::Join(group, rank, size, join_timeout_ms, max_bytes);
  if (!comm.ok()) return comm.status();
  return std::unique_ptr<Communicator>(std::move(comm).value());
}

}  // namespace tandem::parallel
