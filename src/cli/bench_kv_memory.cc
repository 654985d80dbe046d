#include "cli/bench_kv_memory.h"

#include <fmt/format.h>
#include <xxhash.h>

#include <cstring>
#include <future>
#include <random>
#include <vector>

#include "kvtransfer/staging/host_copy_engine.h"
#include "kvtransfer/staging/staged_transport.h"
#include "worker/kv_transport_setup.h"
#ifdef TANDEM_HAVE_CUDA_COPY_ENGINE
#include "kvtransfer/staging/cuda_copy_engine.h"
#endif

namespace tandem::cli::kvbench {

namespace kv = tandem::kvtransfer;

namespace {

// One batch of copies on `io`, waited for.
Status CopyAndWait(kv::CopyEngine& io, kv::CopyKind kind, std::byte* dst, const std::byte* src,
                   uint64_t bytes) {
  const kv::CopyRange range{dst, src, bytes};
  auto done = std::make_shared<std::promise<Status>>();
  std::future<Status> result = done->get_future();
  TANDEM_RETURN_IF_ERROR(io.CopyAsync(kind, std::span<const kv::CopyRange>(&range, 1),
                                      [done](const Status& st) { done->set_value(st); }));
  return result.get();
}

}  // namespace

Status BenchPool::Fill(uint64_t seed) {
  kv::Transport& t = *transport;
  std::vector<std::byte> host;
  std::byte* dst = t.pool();
  if (io) {
    host.resize(t.pool_bytes());
    dst = host.data();
  }
  std::mt19937_64 rng(seed);
  for (uint64_t i = 0; i + 8 <= t.pool_bytes(); i += 8) {
    const uint64_t v = rng();
    std::memcpy(dst + i, &v, 8);
  }
  if (!io) return Status::Ok();
  return CopyAndWait(*io, kv::CopyKind::kHostToDevice, t.pool(), host.data(), t.pool_bytes());
}

Result<uint64_t> BenchPool::Checksum(uint32_t first, uint32_t stride, uint32_t count) {
  kv::Transport& t = *transport;
  std::vector<std::byte> host(io ? t.block_bytes() : 0);
  XXH3_state_t* st = XXH3_createState();
  XXH3_64bits_reset(st);
  Status status;
  for (uint32_t j = 0; j < count && status.ok(); ++j) {
    const std::byte* b = t.block(first + j * stride);
    if (io) {
      status = CopyAndWait(*io, kv::CopyKind::kDeviceToHost, host.data(), b, t.block_bytes());
      b = host.data();
    }
    if (status.ok()) XXH3_64bits_update(st, b, t.block_bytes());
  }
  const uint64_t h = XXH3_64bits_digest(st);
  XXH3_freeState(st);
  if (!status.ok()) return status;
  return h;
}

Status CheckMemoryUsable(const std::string& memory) {
  if (memory != "device") return Status::Ok();
#ifdef TANDEM_HAVE_CUDA_COPY_ENGINE
  auto io = kv::CreateCudaCopyEngine(0);
  if (!io.ok()) return io.status().WithContext("--memory device");
  return Status::Ok();
#else
  return UnimplementedError(
      "--memory device: this build has no CUDA (configure with -DTANDEM_CUDA=ON where nvcc is "
      "installed, and run it on a machine with a GPU)");
#endif
}

Result<BenchPool> CreateBenchPool(const std::string& memory, kv::TransportOptions options) {
  BenchPool p;
  if (memory == "host") {
    TANDEM_ASSIGN_OR_RETURN(p.transport, kv::CreateTransport(options));
    p.path = "host";
    p.detail = fmt::format("{} over a host-memory pool", options.backend);
    return p;
  }
  if (memory == "staged") {
    TANDEM_ASSIGN_OR_RETURN(
        std::unique_ptr<kv::StagedTransport> staged,
        kv::CreateStagedTransport(options, std::make_unique<kv::HostCopyEngine>()));
    p.transport = std::move(staged);
    p.path = "staged";
    p.detail = fmt::format(
        "StagedTransport over {} with the host stand-in copy engine (device pool in host memory)",
        options.backend);
    return p;
  }
  if (memory != "device") {
    return InvalidArgumentError(
        fmt::format("--memory '{}' is not one of host, staged, device", memory));
  }
#ifdef TANDEM_HAVE_CUDA_COPY_ENGINE
  // The copy engine that fills and reads the pool; created first, so that a
  // machine without a GPU is refused naming the device.
  auto io = kv::CreateCudaCopyEngine(0);
  if (!io.ok()) return io.status().WithContext("--memory device");
  auto w = worker::CreateWorkerTransport("cuda", options, options.block_bytes, "auto");
  if (!w.ok()) return w.status().WithContext("--memory device");
  p.io = std::move(io).value();
  p.transport = std::move(w->transport);
  p.path = w->path;
  p.detail = w->detail;
  return p;
#else
  return UnimplementedError(
      "--memory device: this build has no CUDA (configure with -DTANDEM_CUDA=ON where nvcc is "
      "installed, and run it on a machine with a GPU)");
#endif
}

}  // namespace tandem::cli::kvbench
