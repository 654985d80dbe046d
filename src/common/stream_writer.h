// StreamWriter: the one-write-in-flight queue every server-streaming
// callback reactor of the workers needs (Decoder.Decode, Worker.Watch).
//
// gRPC's callback API allows one StartWrite at a time; producers (the engine
// thread, the transport's progress thread, a monitor thread) call Write()
// whenever they have something, and the writer queues it and starts the next
// write from OnWriteDone. Finish() ends the stream after everything queued.
//
// Threads: Write/Finish/Open from any thread. The reactor's OnWriteDone and
// OnCancel forward here. gRPC calls (StartWrite, Finish) are made without
// the writer's lock held. The reactor pointer is used only until Finish has
// been called on it (gRPC calls OnDone, which deletes the reactor, only
// after that), so producers that outlive the RPC are safe: their writes are
// dropped.
//
// The last message and the status leave in one operation
// (StartWriteAndFinish) when the stream is finishing and one message is
// left: one completion (and thread hand-off) less per stream (issue 23).
//
// Coalescing: with a merge function (common/token_merge.h), a message
// written while the previous one still waits in the queue is merged into it
// (never into the one being written), so tokens that are ready together
// leave in one message and none waits for a batch.
#pragma once

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <deque>
#include <mutex>

namespace tandem {

template <class Msg>
class StreamWriter {
 public:
  // Merges `next` into `queued` and returns true, or returns false.
  using MergeFn = bool (*)(Msg& queued, Msg& next);

  explicit StreamWriter(grpc::ServerWriteReactor<Msg>* reactor, MergeFn merge = nullptr)
      : reactor_(reactor), merge_(merge) {}

  // Writes start only after Open (so a first message queued before the
  // request is admitted stays first).
  void Open() {
    std::unique_lock lock(mu_);
    opened_ = true;
    Pump(lock);
  }

  // Queues `msg`; false when the stream is already finishing or cancelled.
  bool Write(Msg msg) {
    std::unique_lock lock(mu_);
    if (final_) return false;
    if (merge_ != nullptr && !queue_.empty() && merge_(queue_.back(), msg)) {
      ++merged_;
      return true;
    }
    queue_.push_back(std::move(msg));
    Pump(lock);
    return true;
  }

  // Queues `msg` as the stream's last message and ends the stream with
  // `status` after it (as Write then Finish, in one gRPC operation when
  // nothing else is queued). False when already finishing or cancelled.
  bool WriteAndFinish(Msg msg, const grpc::Status& status) {
    std::unique_lock lock(mu_);
    if (final_) return false;
    queue_.push_back(std::move(msg));
    final_ = true;
    status_ = status;
    opened_ = true;
    Pump(lock);
    return true;
  }

  // Ends the stream with `status` after the queued messages (first call wins).
  void Finish(const grpc::Status& status) {
    std::unique_lock lock(mu_);
    if (final_) return;
    final_ = true;
    status_ = status;
    opened_ = true;
    Pump(lock);
  }

  // Drops whatever is queued and ends the stream now.
  void Abandon(const grpc::Status& status) {
    std::unique_lock lock(mu_);
    queue_.clear();
    if (!final_) {
      final_ = true;
      status_ = status;
    }
    opened_ = true;
    Pump(lock);
  }

  bool finished() const {
    std::lock_guard lock(mu_);
    return final_;
  }

  // Messages merged into a queued one so far (tests, benchmarks).
  uint64_t merged() const {
    std::lock_guard lock(mu_);
    return merged_;
  }

  // ---- from the reactor ----
  void OnWriteDone(bool ok) {
    std::unique_lock lock(mu_);
    writing_ = false;
    if (!ok) {  // the client went away: nothing more can be written
      queue_.clear();
      if (!final_) {
        final_ = true;
        status_ = grpc::Status(grpc::StatusCode::CANCELLED, "stream write failed");
      }
    }
    Pump(lock);
  }
  void OnCancel() { Abandon(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled by the client")); }

 private:
  // Starts the next write, or Finish once the queue is empty.
  void Pump(std::unique_lock<std::mutex>& lock) {
    if (!opened_ || writing_ || finish_called_) return;
    if (!queue_.empty()) {
      current_ = std::move(queue_.front());
      queue_.pop_front();
      if (final_ && queue_.empty()) {
        // The last message with the status: no OnWriteDone follows, and
        // current_ stays untouched until OnDone.
        finish_called_ = true;
        const grpc::Status status = status_;
        lock.unlock();
        reactor_->StartWriteAndFinish(&current_, grpc::WriteOptions(), status);
        return;
      }
      writing_ = true;
      lock.unlock();
      reactor_->StartWrite(&current_);
      return;
    }
    if (final_) {
      finish_called_ = true;
      const grpc::Status status = status_;
      lock.unlock();
      reactor_->Finish(status);
    }
  }

  grpc::ServerWriteReactor<Msg>* const reactor_;
  const MergeFn merge_;
  mutable std::mutex mu_;
  std::deque<Msg> queue_;
  Msg current_;  // the message being written; untouched while writing_
  bool opened_ = false;
  bool writing_ = false;
  bool final_ = false;
  bool finish_called_ = false;
  uint64_t merged_ = 0;
  grpc::Status status_;
};

}  // namespace tandem
