// The proxy's side of the Watch stream over framed TCP (issue 23,
// docs/serving-workers.md "Watch transport"; the worker's side is
// worker/watch_tcp.h): one framed connection per watch (mutual TLS when the
// internal plane is TLS), the WatchRequest as its first frame, then the
// worker's WorkerUpdate frames.
//
// The proxy's frame loop (common/frame_loop.h: one thread for every Watch
// and Prefill connection) dials, runs the TLS handshake, sends the request
// and reads the updates: at idle it wakes once per worker keep-alive and
// writes nothing back (no WINDOW_UPDATE, no ping). A
// connection that cannot be dialled or authenticated within the handshake
// timeout, or that breaks, ends the watch (not gracefully); a last update
// with `watch_ended` ends it gracefully (the worker leaves).
//
// Threads: Create/Start/Stop from any thread (Stop also from a callback);
// the callbacks run on the frame loop's thread, in order, on_end once and
// last.
#pragma once

#include <google/protobuf/arena.h>

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "common/frame_conn.h"
#include "common/frame_reader.h"
#include "proxy/watch_batch.h"
#include "tandem/v1/worker.pb.h"

namespace tandem::proxy {

// Parses Watch frames into a WorkerUpdate on an arena whose first block is
// owned here and kept between frames (issue 23): a frame's events, their
// stored/removed submessages and hash arrays cost no malloc or free and no
// destructor walk (a reused message deletes and reallocates each event's
// oneof submessage and its hash array per frame). Frames larger than the
// block (snapshots) take more blocks from the heap. The arena is reset
// (earlier updates dropped) once the frames since the last reset add up to
// a quarter of the first block, not per frame.
// One thread at a time.
class WorkerUpdateParser {
 public:
  static constexpr size_t kBlockBytes = size_t{64} << 10;
  WorkerUpdateParser();
  WorkerUpdateParser(const WorkerUpdateParser&) = delete;
  WorkerUpdateParser& operator=(const WorkerUpdateParser&) = delete;
  // The update, valid until the next Parse; nullptr when `payload` is not a
  // WorkerUpdate.
  const v1::WorkerUpdate* Parse(std::string_view payload);

 private:
  std::unique_ptr<char[]> block_;
  google::protobuf::Arena arena_;
  size_t parsed_bytes_ = 0;  // wire bytes parsed since the last Reset
};

class WatchTcpClient : public std::enable_shared_from_this<WatchTcpClient> {
 public:
  struct Callbacks {
    std::function<void(const v1::WorkerUpdate&)> on_update;
    // `graceful`: the worker ended the watch (watch_ended); otherwise `why`
    // says why it broke (or Stop's reason).
    std::function<void(bool graceful, const Status& why)> on_end;
    // A batch of the usual shape (watch_batch.h), read without protobuf;
    // unset: every frame goes to on_update.
    std::function<void(const WatchBatch&)> on_batch;
  };

  static std::shared_ptr<WatchTcpClient> Create(const std::string& address,
                                                std::shared_ptr<FrameTls> tls,
                                                v1::WatchRequest request, FrameOptions options = {});
  // Starts the reader (once).
  void Start(Callbacks callbacks);
  // Ends the watch: no update is handed on after it returns to its caller's
  // thread's next read; on_end follows on the reader thread. Idempotent.
  void Stop(const Status& why);
  ~WatchTcpClient();

  WatchTcpClient(std::shared_ptr<FrameConn> conn, v1::WatchRequest request);  // use Create
  WatchTcpClient(const WatchTcpClient&) = delete;
  WatchTcpClient& operator=(const WatchTcpClient&) = delete;

 private:
  // The reader's hooks.
  Status OnFrame(std::string_view payload);
  void OnEnd(const Status& why);

  const std::shared_ptr<FrameConn> conn_;
  const v1::WatchRequest request_;
  Callbacks callbacks_;
  std::atomic<bool> stopped_{false};
  WorkerUpdateParser parser_;  // the reader thread only
  WatchBatch batch_;           // the reader thread only
  bool graceful_ = false;    // the reader thread only: the worker ended the watch
  FrameReader reader_;  // last: its thread ends before the members above go
};

}  // namespace tandem::proxy
