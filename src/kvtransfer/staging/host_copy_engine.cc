#include "kvtransfer/staging/host_copy_engine.h"

#include <fmt/format.h>

#include <chrono>
#include <cstdlib>
#include <cstring>

namespace tandem::kvtransfer {

HostCopyEngine::HostCopyEngine(HostCopyEngineOptions options)
    : options_(options), thread_([this](std::stop_token st) { Run(st); }) {}

HostCopyEngine::~HostCopyEngine() {
  Drain();
  thread_.request_stop();
  cv_.notify_all();
  thread_.join();
  for (auto& [p, _] : device_) std::free(p);
}

Result<std::byte*> HostCopyEngine::AllocateDevice(uint64_t bytes) {
  if (bytes == 0) return InvalidArgumentError("device allocation of 0 bytes");
  const uint64_t rounded = (bytes + 4095) / 4096 * 4096;
  auto* p = static_cast<std::byte*>(std::aligned_alloc(4096, rounded));
  if (p == nullptr) {
    return ResourceExhaustedError(fmt::format("host stand-in device: {} bytes do not fit", bytes));
  }
  std::memset(p, 0, rounded);
  std::lock_guard lock(mu_);
  device_[p] = bytes;
  return p;
}

void HostCopyEngine::FreeDevice(std::byte* p) {
  if (p == nullptr) return;
  std::lock_guard lock(mu_);
  if (device_.erase(p) != 0) std::free(p);
}

Status HostCopyEngine::PinHost(std::byte* p, uint64_t bytes) {
  std::lock_guard lock(mu_);
  if (!pinned_.emplace(p, bytes).second) return AlreadyExistsError("host range already pinned");
  return Status::Ok();
}

void HostCopyEngine::UnpinHost(std::byte* p) {
  std::lock_guard lock(mu_);
  pinned_.erase(p);
}

Status HostCopyEngine::CopyAsync(CopyKind kind, std::span<const CopyRange> ranges, CopyDone done) {
  for (const CopyRange& r : ranges) {
    if (r.bytes != 0 && (r.dst == nullptr || r.src == nullptr)) {
      return InvalidArgumentError("copy with a null pointer");
    }
  }
  {
    std::lock_guard lock(mu_);
    queue_.push_back({kind, {ranges.begin(), ranges.end()}, std::move(done)});
    ++submitted_;
  }
  cv_.notify_all();
  return Status::Ok();
}

void HostCopyEngine::Drain() {
  std::unique_lock lock(mu_);
  drained_.wait(lock, [&] { return done_ == submitted_; });
}

size_t HostCopyEngine::live_device_allocations() const {
  std::lock_guard lock(mu_);
  return device_.size();
}

size_t HostCopyEngine::live_pinned_ranges() const {
  std::lock_guard lock(mu_);
  return pinned_.size();
}

uint64_t HostCopyEngine::batches_done() const {
  std::lock_guard lock(mu_);
  return done_;
}

void HostCopyEngine::Run(std::stop_token stop) {
  uint64_t index = 0;
  while (true) {
    Batch b;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, stop, [&] { return !queue_.empty(); });
      if (queue_.empty()) return;  // stop requested
      b = std::move(queue_.front());
      queue_.pop_front();
    }
    ++index;
    if (options_.delay_per_batch_us > 0) {
      std::this_thread::sleep_for(std::chrono::microseconds(options_.delay_per_batch_us));
    }
    Status st = Status::Ok();
    if (options_.fail_batch != 0 && index == options_.fail_batch) {
      st = InternalError(fmt::format("host copy engine: injected copy failure (batch {})", index));
    } else {
      for (const CopyRange& r : b.ranges) std::memcpy(r.dst, r.src, r.bytes);
    }
    if (b.done) b.done(st);
    {
      std::lock_guard lock(mu_);
      ++done_;
    }
    drained_.notify_all();
  }
}

}  // namespace tandem::kvtransfer
