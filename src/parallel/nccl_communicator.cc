#include "parallel/nccl_communicator.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cstring>
#include <thread>

namespace tandem::parallel {
namespace {

// Polling an in-flight call: spin on cudaStreamQuery this long, then sleep
// between queries; the peers and NCCL's asynchronous error are checked at
// most every kCheckEvery.
constexpr auto kSpin = std::chrono::microseconds(200);
constexpr auto kSleep = std::chrono::microseconds(50);
constexpr auto kCheckEvery = std::chrono::milliseconds(10);
constexpr auto kFinalizeWait = std::chrono::seconds(5);
constexpr size_t kBootstrapBytes = 4096;  // the bootstrap carries one ncclUniqueId (128 bytes)

std::string CudaError(const char* what, cudaError_t err) {
  return std::string("nccl communicator: ") + what + ": " + cudaGetErrorName(err) + " (" +
         cudaGetErrorString(err) + ")";
}

}  // namespace

int NcclDeviceCount(std::string* why) {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    if (why != nullptr) *why = CudaError("cudaGetDeviceCount", err);
    return 0;
  }
  if (n == 0 && why != nullptr) *why = "cudaGetDeviceCount returned 0 devices";
  return n;
}

Result<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Create(
    std::unique_ptr<ShmCommunicator> bootstrap, int device, CUstream_st* stream,
    int64_t timeout_ms) {
  if (bootstrap == nullptr) {
    return InvalidArgumentError("nccl communicator: a bootstrap shm communicator is required");
  }
  std::string why;
  const int devices = NcclDeviceCount(&why);
  if (device < 0 || device >= devices) {
    return UnavailableError("nccl communicator: rank " + std::to_string(bootstrap->rank()) +
                            " needs CUDA device " + std::to_string(device) + ", this host has " +
                            std::to_string(devices) + (why.empty() ? "" : " (" + why + ")"));
  }
  if (cudaError_t err = cudaSetDevice(device); err != cudaSuccess) {
    return UnavailableError(CudaError("cudaSetDevice", err));
  }
  auto comm = std::unique_ptr<NcclCommunicator>(new NcclCommunicator());
  comm->bootstrap_ = std::move(bootstrap);
  comm->device_ = device;
  if (stream != nullptr) {
    comm->stream_ = stream;
  } else {
    cudaStream_t s = nullptr;
    if (cudaError_t err = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
        err != cudaSuccess) {
      return UnavailableError(CudaError("cudaStreamCreateWithFlags", err));
    }
    comm->stream_ = s;
    comm->own_stream_ = true;
  }

  // Rank 0's unique id to everyone over the bootstrap group.
  ncclUniqueId id;
  std::memset(&id, 0, sizeof(id));
  if (comm->rank() == 0) {
    if (ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess) {
      return UnavailableError(std::string("nccl communicator: ncclGetUniqueId: ") +
                              ncclGetErrorString(r));
    }
  }
  TANDEM_RETURN_IF_ERROR(comm->bootstrap_->Broadcast(
      std::as_writable_bytes(std::span<ncclUniqueId>(&id, 1)), 0));

  // Non-blocking initialisation, so that a peer dying meanwhile or the
  // timeout ends it instead of a hang.
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t nccl = nullptr;
  ncclResult_t r = ncclCommInitRankConfig(&nccl, comm->size(), id, comm->rank(), &config);
  if (r != ncclSuccess && r != ncclInProgress) {
    return UnavailableError(std::string("nccl communicator: ncclCommInitRankConfig: ") +
                            ncclGetErrorString(r));
  }
  comm->comm_ = nccl;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (true) {
    ncclResult_t state = ncclSuccess;
    if (ncclResult_t q = ncclCommGetAsyncError(nccl, &state); q != ncclSuccess) state = q;
    if (state == ncclSuccess) break;
    if (state != ncclInProgress) {
      return comm->Fail(UnavailableError(std::string("nccl communicator: initialisation: ") +
                                         ncclGetErrorString(state) + ": " +
                                         ncclGetLastError(nccl)));
    }
    if (Status s = comm->bootstrap_->CheckPeers(); !s.ok()) return comm->Fail(s);
    if (std::chrono::steady_clock::now() >= deadline) {
      return comm->Fail(DeadlineExceededError(
          "nccl communicator: initialisation of " + std::to_string(comm->size()) +
          " ranks did not finish within " + std::to_string(timeout_ms) + " ms"));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return comm;
}

NcclCommunicator::~NcclCommunicator() {
  if (comm_ != nullptr) {
    bool finalized = false;
    const ncclResult_t r = ncclCommFinalize(comm_);
    if (r == ncclSuccess || r == ncclInProgress) {
      const auto deadline = std::chrono::steady_clock::now() + kFinalizeWait;
      ncclResult_t state = ncclInProgress;
      while (state == ncclInProgress && std::chrono::steady_clock::now() < deadline) {
        if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess) break;
        if (state == ncclInProgress) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      finalized = state == ncclSuccess;
    }
    if (finalized) {
      ncclCommDestroy(comm_);
    } else {
      ncclCommAbort(comm_);
    }
  }
  if (own_stream_ && stream_ != nullptr) cudaStreamDestroy(stream_);
}

Status NcclCommunicator::Fail(Status status) {
  if (failed_.ok()) failed_ = std::move(status);
  if (comm_ != nullptr) {
    ncclCommAbort(comm_);  // ends kernels waiting on a dead peer
    comm_ = nullptr;
  }
  return failed_;
}

Status NcclCommunicator::Check(int nccl_result, const char* what) {
  auto r = static_cast<ncclResult_t>(nccl_result);
  auto next_check = std::chrono::steady_clock::now();
  while (r == ncclInProgress) {
    if (ncclResult_t q = ncclCommGetAsyncError(comm_, &r); q != ncclSuccess) r = q;
    if (r != ncclInProgress) break;
    if (std::chrono::steady_clock::now() >= next_check) {
      if (Status s = bootstrap_->CheckPeers(); !s.ok()) return Fail(s);
      next_check = std::chrono::steady_clock::now() + kCheckEvery;
    }
    std::this_thread::sleep_for(kSleep);
  }
  if (r != ncclSuccess) {
    return Fail(UnavailableError(std::string("nccl communicator: ") + what + ": " +
                                 ncclGetErrorString(r) + ": " + ncclGetLastError(comm_)));
  }
  return Status::Ok();
}

Status NcclCommunicator::Complete(const char* what) {
  const auto start = std::chrono::steady_clock::now();
  auto next_check = start + kCheckEvery;
  while (true) {
    const cudaError_t err = cudaStreamQuery(stream_);
    if (err == cudaSuccess) return Status::Ok();
    if (err != cudaErrorNotReady) {
      return Fail(UnavailableError(CudaError(what, err)));
    }
    const auto now = std::chrono::steady_clock::now();
    if (now >= next_check) {
      ncclResult_t state = ncclSuccess;
      if (ncclResult_t q = ncclCommGetAsyncError(comm_, &state); q != ncclSuccess) state = q;
      if (state != ncclSuccess && state != ncclInProgress) {
        return Fail(UnavailableError(std::string("nccl communicator: ") + what + ": " +
                                     ncclGetErrorString(state) + ": " + ncclGetLastError(comm_)));
      }
      if (Status s = bootstrap_->CheckPeers(); !s.ok()) return Fail(s);
      next_check = now + kCheckEvery;
    }
    if (now - start < kSpin) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(kSleep);
    }
  }
}

Status NcclCommunicator::AllReduceSum(std::span<float> data) {
  if (!failed_.ok()) return failed_;
  if (data.empty()) return Status::Ok();
  TANDEM_RETURN_IF_ERROR(Check(ncclAllReduce(data.data(), data.data(), data.size(), ncclFloat32,
                                             ncclSum, comm_, stream_),
                               "ncclAllReduce"));
  return Complete("ncclAllReduce");
}

Status NcclCommunicator::AllGather(std::span<const float> in, std::span<float> out) {
  if (!failed_.ok()) return failed_;
  if (out.size() != in.size() * static_cast<size_t>(size())) {
    return InvalidArgumentError("nccl communicator: AllGather output has " +
                                std::to_string(out.size()) + " floats; " +
                                std::to_string(size()) + " ranks x " + std::to_string(in.size()) +
                                " need " + std::to_string(in.size() * size()));
  }
  if (in.empty()) return Status::Ok();
  TANDEM_RETURN_IF_ERROR(Check(
      ncclAllGather(in.data(), out.data(), in.size(), ncclFloat32, comm_, stream_),
      "ncclAllGather"));
  return Complete("ncclAllGather");
}

Status NcclCommunicator::Broadcast(std::span<std::byte> data, int root) {
  if (!failed_.ok()) return failed_;
  if (root < 0 || root >= size()) {
    return InvalidArgumentError("nccl communicator: Broadcast root " + std::to_string(root) +
                                " is outside 0.." + std::to_string(size() - 1));
  }
  if (data.empty()) return Status::Ok();
  TANDEM_RETURN_IF_ERROR(Check(ncclBroadcast(data.data(), data.data(), data.size(), ncclUint8,
                                             root, comm_, stream_),
                               "ncclBroadcast"));
  return Complete("ncclBroadcast");
}

Status NcclCommunicator::Send(std::span<const std::byte> data, int dst) {
  if (!failed_.ok()) return failed_;
  if (dst < 0 || dst >= size() || dst == rank()) {
    return InvalidArgumentError("nccl communicator: Send to rank " + std::to_string(dst) +
                                " from rank " + std::to_string(rank()) + " of " +
                                std::to_string(size()) + " (must be another rank)");
  }
  if (data.empty()) return Status::Ok();
  TANDEM_RETURN_IF_ERROR(
      Check(ncclSend(data.data(), data.size(), ncclUint8, dst, comm_, stream_), "ncclSend"));
  return Complete("ncclSend");
}

Status NcclCommunicator::Recv(std::span<std::byte> data, int src) {
  if (!failed_.ok()) return failed_;
  if (src < 0 || src >= size() || src == rank()) {
    return InvalidArgumentError("nccl communicator: Recv from rank " + std::to_string(src) +
                                " at rank " + std::to_string(rank()) + " of " +
                                std::to_string(size()) + " (must be another rank)");
  }
  if (data.empty()) return Status::Ok();
  TANDEM_RETURN_IF_ERROR(
      Check(ncclRecv(data.data(), data.size(), ncclUint8, src, comm_, stream_), "ncclRecv"));
  return Complete("ncclRecv");
}

Status NcclCommunicator::Barrier() {
  if (!failed_.ok()) return failed_;
  TANDEM_RETURN_IF_ERROR(Complete("Barrier"));
  if (Status s = bootstrap_->Barrier(); !s.ok()) return Fail(s);
  return Status::Ok();
}

Result<std::unique_ptr<Communicator>> CreateNcclCommunicator(const std::string& group, int rank,
                                                             int size, int device,
                                                             int64_t join_timeout_ms) {
  auto bootstrap = ShmCommunicator::Join(group, rank, size, join_timeout_ms, kBootstrapBytes);
  if (!bootstrap.ok()) return bootstrap.status();
  auto comm = NcclCommunicator::Create(std::move(bootstrap).value(), device, nullptr,
                                       join_timeout_ms);
  if (!comm.ok()) return comm.status();
  return std::unique_ptr<Communicator>(std::move(comm).value());
}

}  // namespace tandem::parallel
