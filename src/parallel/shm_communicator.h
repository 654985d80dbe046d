// The shared-memory Communicator (issue 18, docs/parallelism.md
// "Communicators"): the CPU ranks of one worker group, processes (or threads
// of one process) on one host, joined through one POSIX shared-memory segment
// named after the group.
//
// Segment: a header, one slot per rank (its pid, its state, a `posted`
// counter of the collective chunks it has entered), one channel per ordered
// pair (src, dst) for Send/Recv, then the data: two collective buffers per
// rank (alternating by chunk parity) and one buffer per ordered pair, each
// `max_bytes` long. Every call larger than max_bytes is split into chunks.
//
// A collective chunk s: the rank waits until every rank has entered chunk
// s - 1 (so nobody still reads its buffer of parity s % 2, last used by chunk
// s - 2), writes its contribution, increments `posted` to s, then waits for
// the ranks it reads from and reads their buffers directly. AllReduceSum
// therefore costs one synchronisation per chunk, and every rank computes the
// same fixed tree (communicator.h) from the same inputs: the same bits.
//
// Waiting spins for ~20 µs, then sleeps on a futex in the segment (woken by
// the poster when a waiter is registered). Every 20 ms of sleep the waiter
// checks the group: a peer whose process has exited (pidfd) while still a
// member breaks the group (UNAVAILABLE naming the rank and pid, for every
// member, sticky); a peer that left in order (its communicator destroyed) is
// an error only for a call still waiting on it.
//
// Segment lifetime: the segment's name is unlinked as soon as the last rank
// joins (the mappings keep it alive), so a crash after that leaks nothing; a
// join that times out removes its rank and the last one out unlinks. A
// segment left by a crash during the join (a member's pid is dead) is
// recognised as stale, unlinked and created afresh.
//
// Thread-safety: one thread per communicator (the rank's engine thread).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "parallel/communicator.h"

namespace tandem::parallel {

class ShmCommunicator final : public Communicator {
 public:
  // See CreateShmCommunicator (communicator.h). INVALID_ARGUMENT for a bad
  // rank/size/max_bytes or a group whose existing members disagree on size
  // or max_bytes; ALREADY_EXISTS when a live process holds `rank`;
  // RESOURCE_EXHAUSTED when /dev/shm cannot hold the segment;
  // DEADLINE_EXCEEDED naming the ranks that did not join in time.
  static Result<std::unique_ptr<ShmCommunicator>> Join(const std::string& group, int rank,
                                                       int size, int64_t join_timeout_ms,
                                                       size_t max_bytes);
  ~ShmCommunicator() override;  // leaves the group (peers waiting on it: UNAVAILABLE)

  ShmCommunicator(const ShmCommunicator&) = delete;
  ShmCommunicator& operator=(const ShmCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string_view kind() const override { return "shm"; }

  Status AllReduceSum(std::span<float> data) override;
  Status AllGather(std::span<const float> in, std::span<float> out) override;
  Status Broadcast(std::span<std::byte> data, int root) override;
  Status Send(std::span<const std::byte> data, int dst) override;
  Status Recv(std::span<std::byte> data, int src) override;
  Status Barrier() override;

  // OK while every member is alive; UNAVAILABLE naming the first rank whose
  // process died (sticky). Cheap enough to call between steps; the nccl
  // communicator calls it while it waits on its stream.
  Status CheckPeers();

  // The POSIX shm name of `group` ("/tandem-comm.<group>", characters
  // outside [A-Za-z0-9._-] replaced by '_').
  static std::string SegmentName(const std::string& group);

  // The fixed tree sum of communicator.h over `n` inputs, elementwise:
  // out[i] = tree(src[0][i], ..., src[n-1][i]). Exposed for tests and for
  // anyone who must reproduce the communicator's bits.
  static void TreeSum(const float* const* src, int n, float* out, size_t count);

 private:
  struct Layout;
  ShmCommunicator() = default;

  enum class Op : uint32_t;
  // Enters the next collective chunk: waits until this rank's buffer of its
  // parity is free, copies `payload` into it, records the call, posts.
  Status Post(Op op, int root, uint64_t call_bytes, std::span<const std::byte> payload);
  // Waits until rank `r` posted the current chunk and checks that it called
  // the same operation.
  Status WaitPeer(int r, Op op, int root, uint64_t call_bytes);
  std::byte* Buffer(int r, uint32_t seq) const;
  // Until `word` >= target (wrapping): spin, then futex slices with a group
  // check between them (`peer`: the rank that must advance `word`).
  Status WaitUntil(std::atomic<uint32_t>& word, std::atomic<uint32_t>& waiters, uint32_t target,
                   int peer);
  Status CheckGroup(int peer);
  // failed_, or the group's shared "broken" mark (one load; no syscall):
  // what every call checks first.
  Status CheckBroken();
  Status Fail(Status status);

  std::string group_;
  std::string name_;
  int rank_ = 0;
  int size_ = 1;
  size_t max_bytes_ = 0;
  size_t buf_bytes_ = 0;
  std::byte* base_ = nullptr;  // the mapping, total_bytes_ long
  size_t total_bytes_ = 0;
  uint32_t seq_ = 0;                 // collective chunks entered by this rank
  std::vector<int> pidfds_;          // per rank; -1 for this process's own ranks
  std::vector<int32_t> pids_;        // per rank
  Status failed_;                    // sticky
};

}  // namespace tandem::parallel
