// One HTTP/2 connection of the native gRPC front end: an nghttp2 server
// session over a non-blocking socket, plain or TLS (h2_io.h; every socket
// read and write, and every SSL call, under mu_) (docs/grpc-frontend.md).
//
// Reading runs on the server's event thread. Calls queue their responses
// from any thread (the decode stream's reader, a work-pool thread, the
// event thread) with Post*, which only append to the stream's outbox and
// mark the connection dirty; the connection is then flushed ONCE for the
// whole batch: at the end of the poster's DeliveryScope
// (common/delivery_scope.h: the decode stream's batch, or the event
// thread's batch of events), or by waking the event thread when no scope is
// open. A flush writes every dirty stream's bytes as DATA frames (our own,
// within the client's windows; HEADERS, trailers and every other frame are
// nghttp2's) and writes all frames that are ready in one send().
//
// Locks: mu_ (session, socket, streams) before a lifecycle's mutex before
// out_mu_ (outboxes, dirty list). Post* take only out_mu_.
#pragma once

#include <nghttp2/nghttp2.h>

#include <array>
#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "common/delivery_scope.h"
#include "common/status.h"
#include "proxy/h2/h2_acks.h"
#include "proxy/h2/h2_io.h"
#include "proxy/h2/h2_stream.h"

namespace tandem::proxy::h2 {

class H2Server;

class H2Connection final : public Flushable,
                           private AckFilter::Sink,
                           public std::enable_shared_from_this<H2Connection> {
 public:
  // `ssl` null: plaintext; else TLS over `fd` (h2_io.h), owned from here.
  H2Connection(int fd, SSL* ssl, H2Server* server);
  ~H2Connection() override;
  H2Connection(const H2Connection&) = delete;
  H2Connection& operator=(const H2Connection&) = delete;

  // Creates the session and queues the server's SETTINGS.
  Status Init();
  int fd() const { return fd_; }
  H2Server* server() const { return server_; }

  // Event thread. false: the connection is over (Close it).
  bool OnReadable();
  bool OnWritable();
  // Event thread: ends every open call as cancelled and closes the socket.
  void Close();
  // Event thread: a stream's deadline passed.
  void Expire(const std::shared_ptr<H2Stream>& s);
  // Event thread (shutdown): GOAWAY; open calls end with `st`.
  void GoAway(const Status& st);
  bool broken() const;
  // The client's HTTP/2 preface (its first SETTINGS) arrived; over TLS
  // that is after the handshake. Event thread (set while reading).
  bool established() const { return established_; }

  // Any thread: hands what calls queued to the session and writes it.
  // `batch`: at the end of a delivery batch (FlushDeferred); then what the
  // client sent meanwhile is read here too, and the socket wakes the event
  // thread only for more than one step's acknowledgements (see Quiet).
  void Flush(bool batch = false);
  // The event thread's own batches (what it read) are not delivery
  // batches: they do not make the connection read quietly.
  void FlushDeferred() override;
  // Event thread: a connection no batch flushed for a while wakes the
  // event thread for every byte again. Returns when to look again (max()
  // when the connection does not read quietly).
  std::chrono::steady_clock::time_point CoolDown(std::chrono::steady_clock::time_point now);

  // Any thread; never blocks on the session. Generate's messages: a delta
  // (merged into the one still queued), and the last message (finish
  // reason and usage), after which the call ends OK.
  void PostDelta(const std::shared_ptr<H2Stream>& s, std::span<const uint32_t> token_ids,
                 std::string_view text);
  void PostFinal(const std::shared_ptr<H2Stream>& s, int32_t finish_reason, uint32_t prompt_tokens,
                 uint32_t completion_tokens, uint32_t cached_prompt_tokens);
  // A unary method's framed reply, then OK.
  void PostUnary(const std::shared_ptr<H2Stream>& s, std::string message);
  // One more message of a server stream of serialized messages (Health/Watch).
  void PostStreamed(const std::shared_ptr<H2Stream>& s, const std::string& message);
  // Ends the call with `st` after what is queued (first status wins).
  void PostStatus(const std::shared_ptr<H2Stream>& s, const Status& st,
                  long long retry_after_s = 0, int http_status = 200);

 private:
  static int OnBeginHeaders(nghttp2_session*, const nghttp2_frame* frame, void* self);
  static int OnHeader(nghttp2_session*, const nghttp2_frame* frame, const uint8_t* name,
                      size_t namelen, const uint8_t* value, size_t valuelen, uint8_t flags,
                      void* self);
  static int OnFrameRecv(nghttp2_session*, const nghttp2_frame* frame, void* self);
  static int OnDataChunk(nghttp2_session*, uint8_t flags, int32_t stream_id, const uint8_t* data,
                         size_t len, void* self);
  static int OnFrameSend(nghttp2_session*, const nghttp2_frame* frame, void* self);
  static int OnStreamClose(nghttp2_session*, int32_t stream_id, uint32_t error_code, void* self);
  // AckFilter::Sink (mu_ held, inside FeedLocked): bytes for the session;
  // the client's WINDOW_UPDATEs, counted here.
  bool Pass(std::span<const uint8_t> bytes) override;
  bool Window(uint32_t stream_id, uint32_t increment) override;
  // mu_ held: the client's SETTINGS changed (initial window, frame size).
  void OnSettingsLocked();
  // mu_ held: GOAWAY with `error_code`; the connection ends.
  void TerminateLocked(uint32_t error_code);

  std::shared_ptr<H2Stream> Find(int32_t id) const;  // mu_ held
  // With out_mu_ held: puts `s` on the dirty list; true when the caller
  // must arrange a flush (none is pending yet).
  bool MarkDirtyLocked(const std::shared_ptr<H2Stream>& s);
  void ScheduleFlush();
  void FlushLocked();          // mu_ held
  // mu_ and out_mu_ held, the stream's wire all sent: moves its queued
  // messages there.
  void TakeOutboxLocked(H2Stream& s);
  void SubmitLocked(H2Stream& s);  // mu_ held: response HEADERS (or Trailers-Only)
  // mu_ held; false: the socket failed. Appends nghttp2's frames and our
  // DATA (WriteDataLocked) to out_ and writes them.
  bool SendLocked();
  // mu_ held, after nghttp2's frames are all in out_: the DATA frames of
  // the sending streams whose HEADERS are out, within the client's windows
  // and SETTINGS_MAX_FRAME_SIZE; a stream whose wire is out and final gets
  // its trailers submitted. true: trailers were submitted (nghttp2 has
  // frames again).
  bool WriteDataLocked();
  void EndCallsLocked();       // mu_ held: every stream's call ends (cancelled)
  // mu_ held: reads what the client sent without blocking; false: the
  // connection is over (the event thread closes it). `flush`: after each
  // read, hands what is ready to the socket (else the caller flushes).
  bool DrainLocked(bool flush = true);
  // mu_ held: what the client sent, through the AckFilter: its
  // WINDOW_UPDATEs counted here, the rest to the session. false: a
  // protocol error (nghttp2 queued GOAWAY).
  bool FeedLocked(std::span<const uint8_t> bytes);
  void SetLowWaterLocked(int bytes);  // SO_RCVLOWAT

  const int fd_;
  H2Server* const server_;
  mutable std::mutex mu_;
  nghttp2_session* session_ = nullptr;                              // guarded by mu_
  std::unordered_map<int32_t, std::shared_ptr<H2Stream>> streams_;  // guarded by mu_
  H2Io io_;               // guarded by mu_: every socket read and write (and TLS)
  std::string out_;       // guarded by mu_: frames not yet written
  size_t out_off_ = 0;    // guarded by mu_
  bool want_write_ = false;  // guarded by mu_: EPOLLOUT armed
  bool closed_ = false;      // guarded by mu_
  bool broken_ = false;      // guarded by mu_: a send failed; the event thread closes it
  std::atomic<bool> established_{false};
  // Quiet reading (docs/grpc-frontend.md): while batches flush this
  // connection, SO_RCVLOWAT is raised just above one step's WINDOW_UPDATE
  // frames, which the next batch's flush reads instead of the event thread.
  int low_water_ = 1;                                     // guarded by mu_
  std::chrono::steady_clock::time_point last_batch_{};   // guarded by mu_
  // Batches flushed since the socket was last read, and how many the mark
  // holds (QuietMark); a window that runs short reads at the next batch.
  // flushed_streams_, flush_wrote_: streams the last flush wrote to, and
  // the DATA bytes it wrote. All guarded by mu_.
  // step_acks_: StepAckBytes of the last batch; drained_: bytes the last
  // DrainLocked read; acks_each_step_: the last read found step_acks_ per
  // batch read (QuietMarkFor).
  int unread_batches_ = 0;
  int read_every_ = 1;
  size_t step_acks_ = 0;
  size_t drained_ = 0;
  bool acks_each_step_ = false;
  int flushed_streams_ = 0;
  int flushed_open_ = 0;  // of those, the ones still open after the flush
  int64_t flush_wrote_ = 0;
  bool window_short_ = false;
  // Response DATA and flow control (h2_acks.h), all guarded by mu_: the
  // client's connection window, its SETTINGS_INITIAL_WINDOW_SIZE and
  // SETTINGS_MAX_FRAME_SIZE, and the streams with DATA or trailers to write.
  AckFilter acks_;
  int64_t conn_window_ = 65535;
  int64_t initial_window_ = 65535;
  size_t max_frame_ = 16384;
  bool flow_error_ = false;  // the client overflowed a window: GOAWAY, no more DATA
  std::vector<std::shared_ptr<H2Stream>> sending_;
  // Where Window looks first (the map's buckets and nodes are cache-cold
  // after a step): open streams by (id / 2) % kRecent; a slot holds an open
  // stream (cleared when it closes) or null.
  static constexpr size_t kRecent = 64;
  std::array<H2Stream*, kRecent> recent_{};
  // nghttp2 is called only when it may have something to do: a step whose
  // only input is WINDOW_UPDATEs and whose only output is DATA never
  // touches the (cache-cold) session. session_out_: a call since the last
  // mem_send that returned nothing may have queued a frame (a submit, bytes
  // fed); session_in_: this read fed it bytes (its want_read/want_write may
  // have changed); goaway_: we ended the session (checked after every read).
  bool session_out_ = true;
  bool session_in_ = false;
  bool goaway_ = false;

  std::mutex out_mu_;
  std::vector<std::shared_ptr<H2Stream>> dirty_;  // guarded by out_mu_
  // FlushLocked's copy of dirty_ (swapped, so both keep their capacity).
  std::vector<std::shared_ptr<H2Stream>> flushing_;  // guarded by mu_
  bool flush_scheduled_ = false;                  // guarded by out_mu_
};

}  // namespace tandem::proxy::h2
