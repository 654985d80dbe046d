#include "cli/bench_kv_encrypt.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <sstream>
#include <thread>

#include "kvtransfer/kv_cipher.h"

namespace tandem::cli::kvbench {

namespace kv = tandem::kvtransfer;
using Clock = std::chrono::steady_clock;

namespace {

// Notice: 'E' | u64 index | u32 count | count x u32 remote slot | key | count x tag.
template <typename T>
void Put(std::string& s, T v) {
  s.append(reinterpret_cast<const char*>(&v), sizeof(v));
}
template <typename T>
bool Get(const std::string& s, size_t& pos, T& v) {
  if (s.size() - pos < sizeof(v)) return false;
  std::memcpy(&v, s.data() + pos, sizeof(v));
  pos += sizeof(v);
  return true;
}

double Since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

}  // namespace

bool EncryptedReceiver::OnNotice(const std::string& p) {
  if (p.empty() || p[0] != 'E') return false;
  size_t pos = 1;
  uint64_t index = 0;
  uint32_t count = 0;
  if (!Get(p, pos, index) || !Get(p, pos, count) ||
      p.size() - pos != uint64_t{count} * (4 + kv::kKvTagBytes) + kv::kKvKeyBytes) {
    std::lock_guard lock(mu_);
    ++failures_;
    return true;
  }
  std::vector<uint32_t> slots(count);
  for (auto& s : slots) Get(p, pos, s);
  const std::string key = p.substr(pos, kv::kKvKeyBytes);
  pos += kv::kKvKeyBytes;
  const auto start = Clock::now();
  uint64_t failed = 0;
  auto cipher = kv::KvCipher::Create(key, index);
  for (uint32_t i = 0; i < count; ++i) {
    const bool ok = cipher.ok() && slots[i] < t_.num_blocks() &&
                    cipher->Open(i, t_.block(slots[i]), t_.block_bytes(),
                                 reinterpret_cast<const std::byte*>(p.data() + pos +
                                                                    i * kv::kKvTagBytes))
                        .ok();
    if (!ok) ++failed;
  }
  const double took = Since(start);
  std::lock_guard lock(mu_);
  open_seconds_ += took;
  failures_ += failed;
  last_opened_ = static_cast<int64_t>(index);
  return true;
}

std::string EncryptedReceiver::Wait(uint64_t index, double timeout_s) {
  const auto give_up = Clock::now() + std::chrono::duration<double>(timeout_s);
  for (;;) {
    {
      std::lock_guard lock(mu_);
      if (last_opened_ >= static_cast<int64_t>(index) || Clock::now() >= give_up) {
        return fmt::format("{} {:.9f} {}", last_opened_, open_seconds_, failures_);
      }
    }
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

Result<EncryptedRun> RunEncrypted(kv::Transport& t, kv::PeerId peer,
                                  const std::vector<kv::BlockPair>& pairs, uint32_t warmup,
                                  uint32_t requests, const AskTarget& ask) {
  if (t.staging_blocks() < pairs.size()) {
    return FailedPreconditionError(fmt::format("{} staging blocks for {} blocks per request",
                                               t.staging_blocks(), pairs.size()));
  }
  std::vector<kv::BlockPair> staged = pairs;
  for (size_t i = 0; i < staged.size(); ++i) staged[i].local_block = t.num_blocks() + static_cast<uint32_t>(i);
  EncryptedRun run;
  double open_before = 0;
  Clock::time_point measure_start;
  for (uint32_t r = 0; r < warmup + requests; ++r) {
    if (r == warmup) measure_start = Clock::now();
    const auto seal_start = Clock::now();
    TANDEM_ASSIGN_OR_RETURN(std::string key, kv::NewKvKey());
    TANDEM_ASSIGN_OR_RETURN(kv::KvCipher cipher, kv::KvCipher::Create(key, r));
    std::string notice = "E";
    Put<uint64_t>(notice, r);
    Put<uint32_t>(notice, static_cast<uint32_t>(pairs.size()));
    for (const auto& p : pairs) Put<uint32_t>(notice, p.remote_slot);
    notice += key;
    std::string tags(pairs.size() * kv::kKvTagBytes, '\0');
    for (size_t i = 0; i < pairs.size(); ++i) {
      TANDEM_RETURN_IF_ERROR(cipher.Seal(static_cast<uint32_t>(i), t.block(pairs[i].local_block),
                                         t.block(staged[i].local_block), t.block_bytes(),
                                         reinterpret_cast<std::byte*>(tags.data()) + i * kv::kKvTagBytes));
    }
    notice += tags;
    const double seal_s = Since(seal_start);
    const auto xfer_start = Clock::now();
    TANDEM_ASSIGN_OR_RETURN(kv::XferId x, t.PrepareBlockWrite(peer, staged, notice));
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    kv::XferStatus status = kv::XferStatus::kInProgress;
    Status detail;
    TANDEM_RETURN_IF_ERROR(t.Post(x, [&](kv::XferId, kv::XferStatus st, const Status& d) {
      std::lock_guard lock(mu);
      status = st;
      detail = d;
      done = true;
      cv.notify_one();
    }));
    {
      std::unique_lock lock(mu);
      if (!cv.wait_for(lock, std::chrono::seconds(60), [&] { return done; })) {
        return DeadlineExceededError(fmt::format("encrypted request {} did not finish in 60 s", r));
      }
    }
    const double xfer_s = Since(xfer_start);
    t.Release(x).IgnoreError();
    if (status != kv::XferStatus::kSuccess) return detail.WithContext("encrypted request");
    TANDEM_ASSIGN_OR_RETURN(std::string answer, ask(r));
    std::istringstream in(answer);
    int64_t opened = -1;
    double open_total = 0;
    uint64_t failures = 0;
    in >> opened >> open_total >> failures;
    if (opened < static_cast<int64_t>(r)) {
      return DeadlineExceededError(fmt::format("the target did not open request {}", r));
    }
    if (r >= warmup) {
      run.seal_s += seal_s;
      run.transfer_s += xfer_s;
      run.open_s += open_total - open_before;
      run.bytes += uint64_t{t.block_bytes()} * pairs.size();
      ++run.requests;
    }
    open_before = open_total;
    run.failures = failures;
  }
  run.total_s = Since(measure_start);
  return run;
}

double MemcpyBandwidth(uint64_t bytes, int reps) {
  std::vector<char> a(bytes, 1), b(bytes, 0);
  double best = 0;
  for (int i = 0; i < reps; ++i) {
    const auto start = Clock::now();
    std::memcpy(b.data(), a.data(), bytes);
    const double s = Since(start);
    if (s > 0) best = std::max(best, static_cast<double>(bytes) / s);
  }
  volatile char sink = b[bytes / 2];
  (void)sink;
  return best;
}

}  // namespace tandem::cli::kvbench
