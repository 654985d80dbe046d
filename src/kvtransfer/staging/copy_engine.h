// The copy engine the staging path (staged_transport.h) is written against:
// device memory plus asynchronous device<->host copies with a completion
// event per batch. Two implementations:
//   - CudaCopyEngine (cuda_copy_engine.h): a non-blocking copy stream, one
//     cudaEvent recorded after each batch, a completion thread that waits
//     on the events in submission order;
//   - HostCopyEngine (host_copy_engine.h): "device" memory is host memory
//     and a real thread does the copies, so the pipeline's ordering,
//     overlap, back-pressure, abort and error paths run in CPU tests.
//
// Threads: every method may be called from any thread. `done` callbacks run
// on the engine's completion thread, one at a time, in submission order;
// they must not block and may call CopyAsync again. CopyAsync never runs
// `done` on the calling thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string_view>

#include "common/status.h"

namespace tandem::kvtransfer {

enum class CopyKind { kDeviceToHost, kHostToDevice };

struct CopyRange {
  std::byte* dst = nullptr;
  const std::byte* src = nullptr;
  uint64_t bytes = 0;
};

using CopyDone = std::function<void(const Status&)>;

class CopyEngine {
 public:
  virtual ~CopyEngine() = default;
  // "cuda" | "host"
  virtual std::string_view name() const = 0;

  // Device memory (the KV pool), zeroed. RESOURCE_EXHAUSTED naming the size when it does not fit.
  virtual Result<std::byte*> AllocateDevice(uint64_t bytes) = 0;
  virtual void FreeDevice(std::byte* p) = 0;
  // Page-locks host memory the transport allocated, so copies to and from
  // it are asynchronous (cudaHostRegister). Unpin before the memory goes.
  virtual Status PinHost(std::byte* p, uint64_t bytes) = 0;
  virtual void UnpinHost(std::byte* p) = 0;

  // Queues the copies of `ranges` (all of one kind) on the copy stream;
  // `done` runs once they all completed, or with the error of the first
  // that failed. An error returned here means nothing was queued and
  // `done` will not run.
  virtual Status CopyAsync(CopyKind kind, std::span<const CopyRange> ranges, CopyDone done) = 0;

  // Waits until every queued copy completed and its `done` returned.
  virtual void Drain() = 0;
};

}  // namespace tandem::kvtransfer
