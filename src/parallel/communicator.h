// Collective communication between the ranks of one worker group (issue 18,
// docs/parallelism.md): tensor-parallel ranks all-reduce and all-gather
// activations, pipeline stages send activations to the next stage, rank 0
// broadcasts each step's plan.
//
// Implementations:
//   - shm  (parallel/shm_communicator.*): CPU ranks, processes on one host,
//          POSIX shared memory; waiting sleeps (futex), never burns a core.
//   - nccl (parallel/nccl_communicator.*): cuda ranks, one device each;
//          buffers are device pointers, calls are ordered on the given stream.
//
// Determinism contract (what makes TP 1/2/4 bit-identical on the CPU):
// AllReduceSum adds the ranks' contributions as a fixed balanced binary tree
// in rank order — size 2: r0 + r1; size 4: (r0 + r1) + (r2 + r3); size 8:
// ((r0+r1)+(r2+r3)) + ((r4+r5)+(r6+r7)) — elementwise, every rank receiving
// the same bits. (NCCL makes no such promise; the nccl implementation says
// so and GPU TP is checked by token equality, not bits.)
//
// Thread-safety: a communicator is used by one thread at a time (the rank's
// engine thread). Every rank of the group must make the same sequence of
// collective calls with the same sizes; a size mismatch is a bug, reported
// as INTERNAL where detectable. A peer that dies makes every pending and
// later call fail with UNAVAILABLE naming the rank (never hang forever):
// implementations watch their peers' liveness.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "common/status.h"

namespace tandem::parallel {

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string_view kind() const = 0;  // "shm", "nccl"

  // In place: data = sum over ranks of data (fixed tree order, see above).
  virtual Status AllReduceSum(std::span<float> data) = 0;
  // out[r * in.size() .. (r+1) * in.size()) = rank r's `in`, on every rank.
  virtual Status AllGather(std::span<const float> in, std::span<float> out) = 0;
  // Root's bytes are copied into every rank's `data` (same size everywhere).
  virtual Status Broadcast(std::span<std::byte> data, int root) = 0;
  // Point to point, matched in call order per (src, dst) pair.
  virtual Status Send(std::span<const std::byte> data, int dst) = 0;
  virtual Status Recv(std::span<std::byte> data, int src) = 0;
  virtual Status Barrier() = 0;
};

// Joins (creating if first) the shared-memory group `group` (a name unique on
// the host, e.g. "tandem-<pid of rank 0>-tp0") as `rank` of `size`.
// Blocks until every rank has joined or `join_timeout_ms` passes
// (DEADLINE_EXCEEDED naming the ranks missing). `max_bytes`: the largest
// single message/collective buffer (larger calls are split internally).
Result<std::unique_ptr<Communicator>> CreateShmCommunicator(const std::string& group, int rank,
                                                            int size, int64_t join_timeout_ms,
                                                            size_t max_bytes = 8u << 20);

}  // namespace tandem::parallel
