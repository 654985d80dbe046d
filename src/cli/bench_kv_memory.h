// The pools `tandem bench kvtransfer --memory host|staged|device` moves KV
// between (docs/kvtransfer.md, docs/cuda.md):
//   host:   the transport's own pool in host memory (ucp_mem_map allocate);
//   staged: the real StagedTransport pipeline over UCX with the host
//           stand-in copy engine (its "device" pool is host memory, one real
//           copy thread): device->host copy, put, manifest, host->device
//           copy on the target, notice after the data;
//   device: a CUDA device pool on device 0 through the path a cuda worker
//           takes (transport.device_path auto: direct UCX registration when
//           UCX supports CUDA memory, else staged with the CUDA copy
//           engine). Refused with a clear error without a GPU.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "common/status.h"
#include "kvtransfer/staging/copy_engine.h"
#include "kvtransfer/transport.h"

namespace tandem::cli::kvbench {

struct BenchPool {
  std::unique_ptr<kvtransfer::Transport> transport;
  // Reads and writes the pool when it is device memory; null: host memory.
  std::unique_ptr<kvtransfer::CopyEngine> io;
  std::string path;    // "host" | "staged" | "direct"
  std::string detail;  // how the bytes travel, for the report

  // Fills the whole pool with a deterministic pseudo-random pattern.
  Status Fill(uint64_t seed);
  // XXH3-64 over blocks first, first + stride, ... (count of them).
  Result<uint64_t> Checksum(uint32_t first, uint32_t stride, uint32_t count);
};

// OK when `memory` can be used on this machine: for device, a CUDA copy
// engine on device 0 can be created (FAILED_PRECONDITION naming the device
// otherwise). Touches no UCX, so it may run before the target is spawned.
Status CheckMemoryUsable(const std::string& memory);

// `memory`: host | staged | device. `options` as for CreateTransport.
Result<BenchPool> CreateBenchPool(const std::string& memory, kvtransfer::TransportOptions options);

}  // namespace tandem::cli::kvbench
