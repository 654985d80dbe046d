#include "engine/cuda_graphs.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

namespace tandem::engine {
namespace {

uint32_t NextPow2(uint32_t n) {
  uint32_t p = 1;
  while (p < n) p <<= 1;
  return p;
}

}  // namespace

uint32_t CudaGraphCache::BatchBucket(uint32_t n) {
  if (n == 0 || n > kMaxBatch) return 0;
  return NextPow2(n);
}

uint32_t CudaGraphCache::BlockBucket(uint32_t blocks) {
  return blocks <= 32 ? 32 : NextPow2(blocks);
}

CudaGraphCache::~CudaGraphCache() { Clear(); }

void CudaGraphCache::Clear() {
  for (auto& [key, e] : entries_) {
    if (e.exec != nullptr) cudaGraphExecDestroy(e.exec);
  }
  entries_.clear();
}

Status CudaGraphCache::Capture(std::pair<uint32_t, uint32_t> key, Entry& e, cudaStream_t stream,
                               const std::function<Status()>& enqueue) {
  std::string why;
  cudaGraph_t graph = nullptr;
  // Thread-local mode: other threads' CUDA calls (a copy stream, another
  // engine) are not disturbed by this thread's capture.
  cudaError_t err = cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal);
  if (err != cudaSuccess) {
    why = fmt::format("cudaStreamBeginCapture: {}", cudaGetErrorString(err));
  } else {
    const Status st = enqueue();
    err = cudaStreamEndCapture(stream, &graph);
    if (!st.ok()) {
      why = st.ToString();
    } else if (err != cudaSuccess || graph == nullptr) {
      why = fmt::format("cudaStreamEndCapture: {}", cudaGetErrorString(err));
    } else {
      cudaGraphExec_t exec = nullptr;
      err = cudaGraphInstantiate(&exec, graph, 0);
      if (err != cudaSuccess) {
        why = fmt::format("cudaGraphInstantiate: {}", cudaGetErrorString(err));
      } else {
        e.exec = exec;
      }
    }
    if (graph != nullptr) cudaGraphDestroy(graph);
  }
  if (e.exec != nullptr) {
    ++stats_.captures;
    spdlog::debug("backend cuda: decode graph captured for batch {} / {} table blocks", key.first,
                  key.second);
    return Status::Ok();
  }
  // Capture errors are not sticky: clear the last one so the eager step
  // that follows starts clean.
  (void)cudaGetLastError();
  e.eager_only = true;
  ++stats_.failed_captures;
  stats_.last_failure = why;
  spdlog::warn(
      "backend cuda: CUDA graph for decode batch {} / {} table blocks could not be captured ({}); "
      "those steps run eagerly",
      key.first, key.second, why);
  return Status::Ok();
}

Status CudaGraphCache::Run(std::pair<uint32_t, uint32_t> key, uint64_t generation,
                           cudaStream_t stream, const std::function<Status()>& enqueue) {
  if (!stats_.enabled) {
    ++stats_.eager_steps;
    return enqueue();
  }
  if (generation != generation_) {
    if (!entries_.empty()) {
      Clear();
      ++stats_.invalidations;
    }
    generation_ = generation;
  }
  Entry& e = entries_[key];
  if (e.exec == nullptr && !e.eager_only) {
    if (!e.seen) {
      e.seen = true;
      ++stats_.eager_steps;
      return enqueue();
    }
    TANDEM_RETURN_IF_ERROR(Capture(key, e, stream, enqueue));
  }
  if (e.exec == nullptr) {
    ++stats_.eager_steps;
    return enqueue();
  }
  const cudaError_t err = cudaGraphLaunch(e.exec, stream);
  if (err != cudaSuccess) {
    return InternalError(fmt::format("backend cuda: cudaGraphLaunch (decode batch {}): {}",
                                     key.first, cudaGetErrorString(err)));
  }
  ++stats_.replays;
  return Status::Ok();
}

}  // namespace tandem::engine
