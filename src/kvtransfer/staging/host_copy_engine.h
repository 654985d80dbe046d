// HostCopyEngine: the copy engine's stand-in for tests without a GPU.
// "Device" memory is ordinary host memory; one real thread performs the
// queued copies in order and runs their callbacks, like a CUDA copy stream
// with its completion thread. Fault injection: a delay before each batch and
// a failure of the Nth batch.
#pragma once

#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "kvtransfer/staging/copy_engine.h"

namespace tandem::kvtransfer {

struct HostCopyEngineOptions {
  uint32_t delay_per_batch_us = 0;  // sleep before performing each batch
  // 1-based index of the batch that fails (INTERNAL "injected copy failure"); 0: none.
  uint64_t fail_batch = 0;
};

class HostCopyEngine final : public CopyEngine {
 public:
  explicit HostCopyEngine(HostCopyEngineOptions options = {});
  ~HostCopyEngine() override;

  std::string_view name() const override { return "host"; }
  Result<std::byte*> AllocateDevice(uint64_t bytes) override;
  void FreeDevice(std::byte* p) override;
  Status PinHost(std::byte* p, uint64_t bytes) override;
  void UnpinHost(std::byte* p) override;
  Status CopyAsync(CopyKind kind, std::span<const CopyRange> ranges, CopyDone done) override;
  void Drain() override;

  // For tests: device allocations and pinned ranges alive now, batches done.
  size_t live_device_allocations() const;
  size_t live_pinned_ranges() const;
  uint64_t batches_done() const;

 private:
  struct Batch {
    CopyKind kind;
    std::vector<CopyRange> ranges;
    CopyDone done;
  };
  void Run(std::stop_token stop);

  const HostCopyEngineOptions options_;
  mutable std::mutex mu_;
  std::condition_variable_any cv_;
  std::condition_variable drained_;
  std::deque<Batch> queue_;   // guarded by mu_
  uint64_t submitted_ = 0;    // guarded by mu_
  uint64_t done_ = 0;         // guarded by mu_
  std::map<std::byte*, uint64_t> device_;  // guarded by mu_
  std::map<std::byte*, uint64_t> pinned_;  // guarded by mu_
  std::jthread thread_;
};

}  // namespace tandem::kvtransfer
