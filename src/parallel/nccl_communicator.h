// The NCCL Communicator (issue 18, docs/parallelism.md "Communicators"): the
// cuda ranks of one worker group, one device each, on one host. Built only
// when CUDA is (TANDEM_HAVE_CUDA; library tandem_parallel_nccl).
//
// Buffers are DEVICE pointers (the spans are never dereferenced on the
// host). Each call is enqueued on the communicator's stream -- the caller's
// stream when one is given at creation, so it is ordered after the caller's
// kernels -- and returns when it completed on the device, so the Status is
// the operation's. Barrier is a host barrier over the bootstrap group once
// the stream is idle.
//
// Bootstrap: a shared-memory communicator over the same ranks (all on one
// host, see docs); rank 0 creates the ncclUniqueId and broadcasts it over it.
// The bootstrap group also watches the peers: NCCL itself would wait forever
// on a dead peer, so while a call is in flight the communicator polls the
// stream, NCCL's asynchronous error and the bootstrap's peer check, and on a
// dead peer aborts the NCCL communicator and returns UNAVAILABLE naming the
// rank (sticky: later calls fail at once).
//
// Order: NCCL does not promise the fixed tree order of communicator.h (its
// ring/tree algorithms and protocols vary with size and topology), so
// AllReduceSum results may differ in the last bits between TP degrees; GPU
// tensor parallelism is checked by token equality, not bits.
//
// Thread-safety: one thread per communicator (the rank's engine thread).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "parallel/communicator.h"
#include "parallel/shm_communicator.h"

struct CUstream_st;  // cudaStream_t without cuda_runtime.h
struct ncclComm;     // ncclComm_t without nccl.h

namespace tandem::parallel {

class NcclCommunicator final : public Communicator {
 public:
  // Uses `device` (cudaSetDevice on the calling thread), makes the NCCL
  // communicator of bootstrap's rank and size. `stream`: the stream to
  // enqueue on (nullptr: a non-blocking stream of its own). `timeout_ms`
  // bounds the NCCL initialisation (DEADLINE_EXCEEDED). UNAVAILABLE when the
  // device, CUDA or NCCL fails, with the runtime's reason.
  static Result<std::unique_ptr<NcclCommunicator>> Create(
      std::unique_ptr<ShmCommunicator> bootstrap, int device, CUstream_st* stream = nullptr,
      int64_t timeout_ms = 60000);
  ~NcclCommunicator() override;

  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override { return bootstrap_->rank(); }
  int size() const override { return bootstrap_->size(); }
  std::string_view kind() const override { return "nccl"; }

  Status AllReduceSum(std::span<float> data) override;       // device memory
  Status AllGather(std::span<const float> in, std::span<float> out) override;
  Status Broadcast(std::span<std::byte> data, int root) override;
  Status Send(std::span<const std::byte> data, int dst) override;
  Status Recv(std::span<std::byte> data, int src) override;
  Status Barrier() override;

  CUstream_st* stream() const { return stream_; }
  int device() const { return device_; }

 private:
  NcclCommunicator() = default;
  // Turns an NCCL call's result into a Status, waiting out ncclInProgress
  // (the communicator is non-blocking).
  Status Check(int nccl_result, const char* what);
  // Waits for the stream, watching NCCL's error and the peers.
  Status Complete(const char* what);
  Status Fail(Status status);

  std::unique_ptr<ShmCommunicator> bootstrap_;
  ncclComm* comm_ = nullptr;
  CUstream_st* stream_ = nullptr;
  bool own_stream_ = false;
  int device_ = 0;
  Status failed_;  // sticky
};

// Number of usable CUDA devices; 0 without a driver or device (the runtime's
// reason in `why` when given).
int NcclDeviceCount(std::string* why = nullptr);

// Convenience: joins the shm group `group` as bootstrap, then makes the NCCL
// communicator on `device`.
Result<std::unique_ptr<Communicator>> CreateNcclCommunicator(const std::string& group, int rank,
                                                             int size, int device,
                                                             int64_t join_timeout_ms);

}  // namespace tandem::parallel
