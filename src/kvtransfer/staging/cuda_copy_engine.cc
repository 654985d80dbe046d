#include "kvtransfer/staging/cuda_copy_engine.h"

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

namespace tandem::kvtransfer {
namespace {

Status FromCuda(cudaError_t err, std::string_view what) {
  if (err == cudaSuccess) return Status::Ok();
  return InternalError(fmt::format("cuda copy engine: {}: {}", what, cudaGetErrorString(err)));
}

class CudaCopyEngine final : public CopyEngine {
 public:
  explicit CudaCopyEngine(int device) : device_(device) {}
  ~CudaCopyEngine() override {
    Drain();
    thread_.request_stop();
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
    cudaSetDevice(device_);
    for (cudaEvent_t e : free_events_) cudaEventDestroy(e);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  Status Init() {
    TANDEM_RETURN_IF_ERROR(FromCuda(cudaSetDevice(device_), fmt::format("cudaSetDevice({})", device_)));
    TANDEM_RETURN_IF_ERROR(
        FromCuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "copy stream"));
    thread_ = std::jthread([this](std::stop_token st) { Run(st); });
    return Status::Ok();
  }

  std::string_view name() const override { return "cuda"; }

  Result<std::byte*> AllocateDevice(uint64_t bytes) override {
    TANDEM_RETURN_IF_ERROR(FromCuda(cudaSetDevice(device_), "cudaSetDevice"));
    void* p = nullptr;
    const cudaError_t err = cudaMalloc(&p, bytes);
    if (err != cudaSuccess) {
      size_t free_b = 0, total_b = 0;
      cudaMemGetInfo(&free_b, &total_b);
      return ResourceExhaustedError(fmt::format(
          "cuda copy engine: the device KV pool needs {:.2f} GiB; {:.2f} GiB of {:.2f} GiB free "
          "on device {} ({})",
          bytes / 1073741824.0, free_b / 1073741824.0, total_b / 1073741824.0, device_,
          cudaGetErrorString(err)));
    }
    if (Status st = FromCuda(cudaMemset(p, 0, bytes), "clearing the device KV pool"); !st.ok()) {
      cudaFree(p);
      return st;
    }
    return static_cast<std::byte*>(p);
  }
  void FreeDevice(std::byte* p) override {
    if (p == nullptr) return;
    cudaSetDevice(device_);
    cudaFree(p);
  }
  Status PinHost(std::byte* p, uint64_t bytes) override {
    TANDEM_RETURN_IF_ERROR(FromCuda(cudaSetDevice(device_), "cudaSetDevice"));
    return FromCuda(cudaHostRegister(p, bytes, cudaHostRegisterDefault),
                    fmt::format("cudaHostRegister of the {} byte transport pool", bytes));
  }
  void UnpinHost(std::byte* p) override {
    cudaSetDevice(device_);
    cudaHostUnregister(p);
  }

  Status CopyAsync(CopyKind kind, std::span<const CopyRange> ranges, CopyDone done) override {
    const cudaMemcpyKind k =
        kind == CopyKind::kDeviceToHost ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice;
    std::lock_guard lock(mu_);  // one batch at a time on the stream, events in queue order
    TANDEM_RETURN_IF_ERROR(FromCuda(cudaSetDevice(device_), "cudaSetDevice"));
    for (const CopyRange& r : ranges) {
      if (r.bytes == 0) continue;
      Status st = FromCuda(cudaMemcpyAsync(r.dst, r.src, r.bytes, k, stream_),
                           kind == CopyKind::kDeviceToHost ? "device-to-host copy"
                                                           : "host-to-device copy");
      if (!st.ok()) {
        // The caller frees the buffers on error: let what was queued finish first.
        cudaStreamSynchronize(stream_);
        return st;
      }
    }
    cudaEvent_t ev = nullptr;
    if (!free_events_.empty()) {
      ev = free_events_.back();
      free_events_.pop_back();
    } else {
      TANDEM_RETURN_IF_ERROR(FromCuda(
          cudaEventCreateWithFlags(&ev, cudaEventDisableTiming | cudaEventBlockingSync),
          "copy completion event"));
    }
    if (Status st = FromCuda(cudaEventRecord(ev, stream_), "recording a copy event"); !st.ok()) {
      free_events_.push_back(ev);
      return st;
    }
    queue_.push_back({ev, std::move(done)});
    ++submitted_;
    cv_.notify_all();
    return Status::Ok();
  }

  void Drain() override {
    std::unique_lock lock(mu_);
    drained_.wait(lock, [&] { return done_ == submitted_; });
  }

 private:
  struct Pending {
    cudaEvent_t event;
    CopyDone done;
  };

  void Run(std::stop_token stop) {
    cudaSetDevice(device_);
    while (true) {
      Pending p;
      {
        std::unique_lock lock(mu_);
        cv_.wait(lock, stop, [&] { return !queue_.empty(); });
        if (queue_.empty()) return;
        p = std::move(queue_.front());
        queue_.pop_front();
      }
      const Status st = FromCuda(cudaEventSynchronize(p.event), "copy");
      if (p.done) p.done(st);
      {
        std::lock_guard lock(mu_);
        free_events_.push_back(p.event);
        ++done_;
      }
      drained_.notify_all();
    }
  }

  const int device_;
  cudaStream_t stream_ = nullptr;
  std::mutex mu_;
  std::condition_variable_any cv_;
  std::condition_variable_any drained_;
  std::deque<Pending> queue_;              // guarded by mu_
  std::vector<cudaEvent_t> free_events_;  // guarded by mu_
  uint64_t submitted_ = 0;                 // guarded by mu_
  uint64_t done_ = 0;                      // guarded by mu_
  std::jthread thread_;
};

}  // namespace

Result<std::unique_ptr<CopyEngine>> CreateCudaCopyEngine(int device) {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess || n == 0) {
    return FailedPreconditionError(fmt::format(
        "cuda copy engine: no usable CUDA device ({})",
        err != cudaSuccess ? cudaGetErrorString(err) : "cudaGetDeviceCount returned 0"));
  }
  if (device < 0 || device >= n) {
    return InvalidArgumentError(fmt::format("cuda copy engine: device {} does not exist ({} found)",
                                            device, n));
  }
  auto engine = std::make_unique<CudaCopyEngine>(device);
  TANDEM_RETURN_IF_ERROR(engine->Init());
  return std::unique_ptr<CopyEngine>(std::move(engine));
}

}  // namespace tandem::kvtransfer
