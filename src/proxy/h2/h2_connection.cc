#include "proxy/h2/h2_connection.h"

#include <fmt/format.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "proxy/h2/grpc_calls.h"
#include "proxy/h2/grpc_wire.h"
#include "proxy/h2/h2_server.h"

namespace tandem::proxy::h2 {
namespace {

// Streams one connection may have open (SETTINGS_MAX_CONCURRENT_STREAMS):
// the 1,000-stream benchmark over one channel fits; the proxy's admission
// (proxy.max_inflight) is the real bound.
constexpr uint32_t kMaxConcurrentStreams = 4096;
// Per-stream receive window: an 8k-token prompt (~30 KB) in one flight.
constexpr uint32_t kInitialWindow = 1 << 20;
// Quiet reading (QuietMarkFor, h2_acks.h): a window with less room than
// this many times what a flush wrote into it is read at the next batch,
// whatever the read schedule.
constexpr int64_t kShortWindowSteps = 8;
// Frames buffered before a write; past it, the socket must drain first
// (a client that does not read stops the session's output here).
constexpr size_t kHighWater = 256 << 10;
// RFC 9113 6.9.1: a flow-control window never exceeds 2^31-1.
constexpr int64_t kMaxWindow = 0x7fffffff;

// A DATA frame's header (no flags: the trailers end the stream).
void AppendDataHeader(std::string& out, size_t length, int32_t stream_id) {
  const char header[9] = {static_cast<char>(length >> 16), static_cast<char>(length >> 8),
                          static_cast<char>(length), 0 /* DATA */, 0,
                          static_cast<char>(stream_id >> 24), static_cast<char>(stream_id >> 16),
                          static_cast<char>(stream_id >> 8), static_cast<char>(stream_id)};
  out.append(header, sizeof header);
}

nghttp2_nv Nv(std::string_view name, std::string_view value) {
  return nghttp2_nv{reinterpret_cast<uint8_t*>(const_cast<char*>(name.data())),
                    reinterpret_cast<uint8_t*>(const_cast<char*>(value.data())), name.size(),
                    value.size(), NGHTTP2_NV_FLAG_NONE};
}

// The trailers of a finished call (also the Trailers-Only response's).
struct Trailers {
  std::string code, message, retry_after, http_status;
  std::vector<nghttp2_nv> nv;
  Trailers(const H2Stream& s, bool trailers_only) {
    code = std::to_string(s.status_code);
    message = PercentEncode(s.status_message);
    if (trailers_only) {
      http_status = std::to_string(s.http_status);
      nv.push_back(Nv(":status", http_status));
      nv.push_back(Nv("content-type", "application/grpc"));
    }
    nv.push_back(Nv("grpc-status", code));
    if (!message.empty()) nv.push_back(Nv("grpc-message", message));
    if (s.retry_after_s > 0) {
      retry_after = std::to_string(s.retry_after_s);
      nv.push_back(Nv("retry-after", retry_after));
    }
  }
};

}  // namespace

H2Connection::H2Connection(int fd, SSL* ssl, H2Server* server)
    : fd_(fd), server_(server), io_(fd, ssl) {}

H2Connection::~H2Connection() {
  if (session_ != nullptr) nghttp2_session_del(session_);
  if (!closed_) close(fd_);
}

Status H2Connection::Init() {
  nghttp2_session_callbacks* cb = nullptr;
  if (nghttp2_session_callbacks_new(&cb) != 0) return InternalError("nghttp2: out of memory");
  nghttp2_session_callbacks_set_on_begin_headers_callback(cb, &OnBeginHeaders);
  nghttp2_session_callbacks_set_on_header_callback(cb, &OnHeader);
  nghttp2_session_callbacks_set_on_frame_recv_callback(cb, &OnFrameRecv);
  nghttp2_session_callbacks_set_on_data_chunk_recv_callback(cb, &OnDataChunk);
  nghttp2_session_callbacks_set_on_stream_close_callback(cb, &OnStreamClose);
  nghttp2_session_callbacks_set_on_frame_send_callback(cb, &OnFrameSend);
  const int rc = nghttp2_session_server_new(&session_, cb, this);
  nghttp2_session_callbacks_del(cb);
  if (rc != 0) return InternalError(fmt::format("nghttp2: {}", nghttp2_strerror(rc)));
  const nghttp2_settings_entry iv[] = {
      {NGHTTP2_SETTINGS_MAX_CONCURRENT_STREAMS, kMaxConcurrentStreams},
      {NGHTTP2_SETTINGS_INITIAL_WINDOW_SIZE, kInitialWindow},
  };
  std::lock_guard lock(mu_);
  if (int e = nghttp2_submit_settings(session_, NGHTTP2_FLAG_NONE, iv, std::size(iv)); e != 0) {
    return InternalError(fmt::format("nghttp2: {}", nghttp2_strerror(e)));
  }
  // The connection's receive window as large as a stream's.
  nghttp2_session_set_local_window_size(session_, NGHTTP2_FLAG_NONE, 0, kInitialWindow);
  return Status::Ok();
}

bool H2Connection::broken() const {
  std::lock_guard lock(mu_);
  return broken_ || closed_;
}

std::shared_ptr<H2Stream> H2Connection::Find(int32_t id) const {
  auto it = streams_.find(id);
  return it == streams_.end() ? nullptr : it->second;
}

bool H2Connection::OnReadable() {
  std::lock_guard lock(mu_);
  if (closed_) return false;
  return DrainLocked();
}

bool H2Connection::DrainLocked(bool flush) {
  // Under mu_: a batch's flush may read this socket too, and the bytes
  // must reach nghttp2 in order.
  unread_batches_ = 0;  // what the batches' clients sent so far is read here
  drained_ = 0;
  uint8_t buf[64 << 10];
  for (;;) {
    const bool was_ready = io_.ready();
    const H2Io::Got got = io_.Read(buf, sizeof buf);
    if (got.closed) return false;  // the client closed, or TLS failed
    if (!was_ready && io_.ready()) {
      // TLS: the handshake is done; the server's SETTINGS waited for it.
      FlushLocked();
      if (broken_) return false;
    }
    if (got.n == 0) {
      // Nothing more now; TLS handshake replies may wait to be sent.
      return !io_.pending() || SendLocked();
    }
    const size_t n = got.n;
    drained_ += n;
    session_in_ = false;
    if (!FeedLocked({buf, n})) {
      // A protocol error: nghttp2 queued GOAWAY; send it, then close.
      SendLocked();
      return false;
    }
    if (flush) {
      FlushLocked();
      if (broken_) return false;
    }
    // (A read the AckFilter took whole changed nothing in the session.)
    if ((session_in_ || goaway_) && !nghttp2_session_want_read(session_) &&
        !nghttp2_session_want_write(session_)) {
      return false;
    }
    // Plaintext: a short read drained the socket. TLS reads until nothing is
    // left (records may be buffered where epoll does not see them).
    if (!io_.tls() && n < sizeof buf) return true;
  }
}

bool H2Connection::FeedLocked(std::span<const uint8_t> bytes) {
  return acks_.Split(bytes, *this);
}

bool H2Connection::Pass(std::span<const uint8_t> bytes) {
  session_in_ = session_out_ = true;
  return nghttp2_session_mem_recv(session_, bytes.data(), bytes.size()) >= 0;
}

bool H2Connection::Window(uint32_t stream_id, uint32_t increment) {
  // Increment 0 is an error nghttp2 answers (PROTOCOL_ERROR), as it does
  // an update of a stream that is not open (ignored when closed): they go
  // to it. Its own windows never count DATA (it sends none), so the
  // updates it does see are bounded by what a client can send for a
  // closed stream.
  if (increment == 0) return false;
  if (stream_id == 0) {
    conn_window_ += increment;
    if (conn_window_ > kMaxWindow && !flow_error_) {
      flow_error_ = true;  // RFC 9113 6.9.1: a connection error
      TerminateLocked(NGHTTP2_FLOW_CONTROL_ERROR);
    }
    return true;
  }
  const int32_t id = static_cast<int32_t>(stream_id);
  H2Stream* s = recent_[(stream_id >> 1) % kRecent];
  if (s == nullptr || s->id != id) {
    auto it = streams_.find(id);
    s = it == streams_.end() ? nullptr : it->second.get();
  }
  if (s == nullptr || !s->in_session) return false;
  s->send_window += increment;
  if (s->send_window > kMaxWindow && !s->eof) {
    // A stream error: RST_STREAM; its queued data is never written.
    s->eof = true;
    session_out_ = session_in_ = true;
    nghttp2_submit_rst_stream(session_, NGHTTP2_FLAG_NONE, s->id, NGHTTP2_FLOW_CONTROL_ERROR);
  }
  return true;
}

void H2Connection::TerminateLocked(uint32_t error_code) {
  session_out_ = session_in_ = goaway_ = true;
  nghttp2_session_terminate_session(session_, error_code);
}

void H2Connection::OnSettingsLocked() {
  // nghttp2 applied them already (it calls OnFrameRecv after).
  const int64_t initial =
      nghttp2_session_get_remote_settings(session_, NGHTTP2_SETTINGS_INITIAL_WINDOW_SIZE);
  max_frame_ = nghttp2_session_get_remote_settings(session_, NGHTTP2_SETTINGS_MAX_FRAME_SIZE);
  if (initial == initial_window_) return;
  // RFC 9113 6.9.2: the change applies to every open stream's window.
  const int64_t delta = initial - initial_window_;
  initial_window_ = initial;
  for (auto& [id, s] : streams_) {
    s->send_window += delta;
    if (s->send_window > kMaxWindow && !flow_error_) {
      flow_error_ = true;
      TerminateLocked(NGHTTP2_FLOW_CONTROL_ERROR);
    }
  }
}

void H2Connection::SetLowWaterLocked(int bytes) {
  if (bytes == low_water_) return;
  // Lowering it makes the kernel report what is already there.
  setsockopt(fd_, SOL_SOCKET, SO_RCVLOWAT, &bytes, sizeof bytes);
  if (low_water_ == 1) server_->ChangeQuiet(+1);
  if (bytes == 1) server_->ChangeQuiet(-1);
  low_water_ = bytes;
}

std::chrono::steady_clock::time_point H2Connection::CoolDown(
    std::chrono::steady_clock::time_point now) {
  std::lock_guard lock(mu_);
  if (closed_ || low_water_ == 1) return std::chrono::steady_clock::time_point::max();
  if (now - last_batch_ < kQuietFor) return last_batch_ + kQuietFor;
  SetLowWaterLocked(1);
  if (!DrainLocked()) broken_ = true;
  return std::chrono::steady_clock::time_point::max();
}

bool H2Connection::OnWritable() {
  std::lock_guard lock(mu_);
  if (closed_) return false;
  FlushLocked();
  return !broken_;
}

void H2Connection::FlushDeferred() { Flush(/*batch=*/!H2Server::OnEventThread()); }

void H2Connection::Flush(bool batch) {
  bool broke;
  {
    std::lock_guard lock(mu_);
    if (closed_) return;
    const bool quiet = batch && !broken_ && !streams_.empty();
    if (quiet) {
      // The client's acknowledgements of the previous batch (and anything
      // else it sent) are read here, on a thread that is running anyway;
      // until the next batch the event thread wakes only for more than
      // one step's acknowledgements: a request, or a connection that
      // fell quiet (CoolDown). Read BEFORE this batch is written: a client
      // acknowledges within ~0.1 ms, so read after the write this batch's
      // acknowledgements joined the previous batch's in the socket, crossed
      // the low-water mark and woke the event thread, which then found
      // them read already (~0.6 empty wake-ups per step in `stream`).
      // (The flush below sends what reading them queued too.)
      // The acknowledgements (WINDOW_UPDATE) are counted here (AckFilter)
      // and never reach nghttp2. Several steps' acknowledgements may wait
      // in the socket (QuietMark): read when as many batches went out
      // since the last read as the mark holds, or when a window runs short.
      if (unread_batches_ >= read_every_ || window_short_) {
        const size_t expected = static_cast<size_t>(unread_batches_) * step_acks_;
        if (!DrainLocked(/*flush=*/false)) broken_ = true;
        // Only a client that acknowledges every step (gRPC C++) may have
        // several steps wait: one that acknowledges lazily (nghttp2 and Go
        // at half the window) leaves the socket empty, and a small request
        // below a several-step mark would wait for the read. (Half: a
        // stream that ended in a batch gets no update of its own.)
        if (expected > 0) acks_each_step_ = 2 * drained_ >= expected;
      }
    }
    if (!broken_) FlushLocked();
    // Quiet only while a stream the batch wrote to goes on: after a batch
    // that ended all of them (`prompt`: one token, then the trailers) the
    // next batch may be far off, and a raised mark would cost two
    // setsockopt and CoolDown's wake-up for nothing.
    if (quiet && !broken_ && flushed_open_ > 0 && !streams_.empty()) {
      last_batch_ = DeliveryScope::Now();  // (the batch's: no clock read per connection)
      ++unread_batches_;
      // The streams this batch wrote to are the ones the client
      // acknowledges. (TLS: the client's write is one record, its
      // overhead on top.)
      const int streams = std::max(flushed_streams_, 1);
      const QuietMark mark = QuietMarkFor(streams, io_.record_overhead(), acks_each_step_);
      read_every_ = mark.read_every;
      step_acks_ = static_cast<size_t>(StepAckBytes(streams));
      SetLowWaterLocked(mark.low_water);
    }
    broke = broken_;
  }
  if (broke) server_->Wake(shared_from_this());
}

void H2Connection::Close() {
  std::unordered_map<int32_t, std::shared_ptr<H2Stream>> streams;
  {
    std::lock_guard lock(mu_);
    if (closed_) return;
    closed_ = true;
    if (low_water_ != 1) server_->ChangeQuiet(-1);
    low_water_ = 1;
    streams.swap(streams_);
    for (auto& [id, s] : streams) s->in_session = false;
    sending_.clear();
    recent_.fill(nullptr);
    io_.CloseNotify();
    close(fd_);
  }
  {
    std::lock_guard lock(out_mu_);
    for (auto& [id, s] : streams) s->out_closed = true;
    dirty_.clear();
  }
  for (auto& [id, s] : streams) OnStreamClosed(*s, *server_->frontend());
}

void H2Connection::Expire(const std::shared_ptr<H2Stream>& s) {
  std::lock_guard lock(mu_);
  if (closed_ || Find(s->id) != s) return;
  AbortCall(*this, s, DeadlineExceededError("deadline exceeded"));
}

void H2Connection::GoAway(const Status& st) {
  std::lock_guard lock(mu_);
  if (closed_) return;
  for (auto& [id, s] : streams_) AbortCall(*this, s, st);
  session_out_ = goaway_ = true;
  nghttp2_submit_goaway(session_, NGHTTP2_FLAG_NONE,
                        nghttp2_session_get_last_proc_stream_id(session_), NGHTTP2_NO_ERROR,
                        nullptr, 0);
}

// ---- Posting (any thread).

bool H2Connection::MarkDirtyLocked(const std::shared_ptr<H2Stream>& s) {
  if (!s->dirty) {
    s->dirty = true;
    dirty_.push_back(s);
  }
  if (flush_scheduled_) return false;
  flush_scheduled_ = true;
  return true;
}

void H2Connection::ScheduleFlush() {
  // In a delivery batch (the decode stream's reader, the event thread):
  // one flush at its end. Otherwise the event thread flushes.
  if (!DeliveryScope::Defer(shared_from_this())) server_->Wake(shared_from_this());
}

void H2Connection::PostDelta(const std::shared_ptr<H2Stream>& s,
                             std::span<const uint32_t> token_ids, std::string_view text) {
  bool schedule;
  {
    std::lock_guard lock(out_mu_);
    if (s->out_closed || s->finishing) return;
    // A queued delta takes this one's tokens and text (nothing but deltas
    // is queued before the final message, which ends the posts).
    s->delta_queued = true;
    s->delta_ids.insert(s->delta_ids.end(), token_ids.begin(), token_ids.end());
    s->delta_text.append(text);
    schedule = MarkDirtyLocked(s);
  }
  if (schedule) ScheduleFlush();
}

void H2Connection::PostFinal(const std::shared_ptr<H2Stream>& s, int32_t finish_reason,
                             uint32_t prompt_tokens, uint32_t completion_tokens,
                             uint32_t cached_prompt_tokens) {
  bool schedule;
  {
    std::lock_guard lock(out_mu_);
    if (s->out_closed || s->finishing) return;
    s->final_queued = true;
    s->final_reason = finish_reason;
    s->final_usage[0] = prompt_tokens;
    s->final_usage[1] = completion_tokens;
    s->final_usage[2] = cached_prompt_tokens;
    s->finishing = true;
    s->status_code = 0;
    schedule = MarkDirtyLocked(s);
  }
  if (schedule) ScheduleFlush();
}

void H2Connection::PostUnary(const std::shared_ptr<H2Stream>& s, std::string message) {
  bool schedule;
  {
    std::lock_guard lock(out_mu_);
    if (s->out_closed || s->finishing) return;
    AppendMessagePrefix(s->pending_raw, static_cast<uint32_t>(message.size()));
    s->pending_raw.append(message);
    s->finishing = true;
    s->status_code = 0;
    schedule = MarkDirtyLocked(s);
  }
  if (schedule) ScheduleFlush();
}

void H2Connection::PostStreamed(const std::shared_ptr<H2Stream>& s, const std::string& message) {
  bool schedule;
  {
    std::lock_guard lock(out_mu_);
    if (s->out_closed || s->finishing) return;
    AppendMessagePrefix(s->pending_raw, static_cast<uint32_t>(message.size()));
    s->pending_raw.append(message);
    schedule = MarkDirtyLocked(s);
  }
  if (schedule) ScheduleFlush();
}

void H2Connection::PostStatus(const std::shared_ptr<H2Stream>& s, const Status& st,
                              long long retry_after_s, int http_status) {
  s->answered = true;
  bool schedule;
  {
    std::lock_guard lock(out_mu_);
    if (s->out_closed || s->finishing) return;
    s->finishing = true;
    s->status_code = static_cast<int>(st.code());
    s->status_message = st.message();
    s->retry_after_s = retry_after_s;
    s->http_status = http_status;
    schedule = MarkDirtyLocked(s);
  }
  if (schedule) ScheduleFlush();
}

// ---- Flushing (mu_ held).

void H2Connection::FlushLocked() {
  std::vector<std::shared_ptr<H2Stream>>& dirty = flushing_;
  dirty.clear();
  {
    // One lock for the whole flush: every dirty stream's queued messages
    // move to its wire here, so WriteDataLocked takes none.
    std::lock_guard lock(out_mu_);
    flush_scheduled_ = false;
    dirty.swap(dirty_);
    for (auto& s : dirty) {
      s->dirty = false;
      if (s->eof || !s->in_session) continue;
      if (s->wire_off == s->wire.size()) {
        TakeOutboxLocked(*s);
      } else {
        // The client's window holds the wire back: later deltas merge in
        // the outbox meanwhile (one message, not one per step), and
        // WriteDataLocked takes them when the wire is out.
        s->outbox_waits = true;
      }
    }
  }
  flushed_streams_ = 0;
  flush_wrote_ = 0;
  window_short_ = false;  // WriteDataLocked looks at every sending stream
  for (auto& s : dirty) {
    if (s->eof || !s->in_session) continue;  // ended, or closed meanwhile
    ++flushed_streams_;
    if (!s->submitted) SubmitLocked(*s);
    if (!s->eof && !s->sending) {
      s->sending = true;
      sending_.push_back(s);
    }
  }
  if (!SendLocked()) broken_ = true;
  flushed_open_ = 0;
  for (auto& s : dirty) flushed_open_ += !s->eof && s->in_session;
  // RFC 9113 5.4.1: after the GOAWAY of a connection error the connection
  // closes; once that GOAWAY is written, the event thread closes it.
  if (flow_error_ && out_.empty() && !nghttp2_session_want_write(session_)) broken_ = true;
}

void H2Connection::TakeOutboxLocked(H2Stream& s) {
  s.wire.clear();  // (all sent) keeps its capacity
  s.wire_off = 0;
  s.outbox_waits = false;
  if (s.delta_queued) {
    AppendGenerateResponse(s.wire, s.request_id, s.delta_ids, s.delta_text, 0, nullptr);
    s.delta_queued = false;
    s.delta_ids.clear();
    s.delta_text.clear();
  }
  if (s.final_queued) {
    const UsageFields u{s.final_usage[0], s.final_usage[1], s.final_usage[2]};
    AppendGenerateResponse(s.wire, s.request_id, {}, {}, s.final_reason, &u);
    s.final_queued = false;
  }
  if (!s.pending_raw.empty()) {
    s.wire.append(s.pending_raw);
    s.pending_raw.clear();
  }
  // The outbox is empty now: a final status ends the stream after the wire.
  s.wire_final = s.finishing;
}

void H2Connection::SubmitLocked(H2Stream& s) {
  s.submitted = true;
  session_out_ = true;
  if (s.wire_final && s.wire_off == s.wire.size()) {
    // Nothing but a status: one HEADERS frame that ends the stream.
    s.eof = true;
    Trailers t(s, /*trailers_only=*/true);
    nghttp2_submit_response(session_, s.id, t.nv.data(), t.nv.size(), nullptr);
    return;
  }
  // The response HEADERS without END_STREAM; the DATA is ours
  // (WriteDataLocked), once OnFrameSend saw them go out.
  const nghttp2_nv nv[] = {Nv(":status", "200"), Nv("content-type", "application/grpc")};
  nghttp2_submit_headers(session_, NGHTTP2_FLAG_NONE, s.id, nullptr, nv, std::size(nv), nullptr);
}

bool H2Connection::WriteDataLocked() {
  bool trailers = false;
  size_t keep = 0;
  for (size_t i = 0; i < sending_.size(); ++i) {
    H2Stream& s = *sending_[i];
    // Ended, reset or closed: what it still had queued is dropped, never
    // written after its RST_STREAM or trailers.
    bool done = s.eof || !s.in_session || flow_error_;
    if (!done && s.headers_out && out_.size() - out_off_ < kHighWater) {
      if (s.outbox_waits && s.wire_off == s.wire.size()) {
        // What was posted while the client's window held the wire back.
        std::lock_guard lock(out_mu_);
        TakeOutboxLocked(s);
      }
      const size_t wire_was = s.wire_off;
      while (s.wire_off < s.wire.size()) {
        const int64_t room =
            std::min({conn_window_, s.send_window, static_cast<int64_t>(max_frame_)});
        if (room <= 0) break;  // waits for the client's WINDOW_UPDATE
        const size_t n = std::min(s.wire.size() - s.wire_off, static_cast<size_t>(room));
        AppendDataHeader(out_, n, s.id);
        out_.append(s.wire, s.wire_off, n);
        s.wire_off += n;
        conn_window_ -= static_cast<int64_t>(n);
        s.send_window -= static_cast<int64_t>(n);
      }
      // A window that would not take kShortWindowSteps more writes like
      // this one (or that holds the wire back now): the next batch reads
      // the client's acknowledgements, whatever the read schedule.
      const int64_t wrote = static_cast<int64_t>(s.wire_off - wire_was);
      flush_wrote_ += wrote;
      if (s.wire_off < s.wire.size() || s.send_window < kShortWindowSteps * wrote ||
          conn_window_ < kShortWindowSteps * flush_wrote_) {
        window_short_ = true;
      }
      if (s.wire_off == s.wire.size()) {
        if (s.wire_final) {
          s.eof = true;
          Trailers t(s, /*trailers_only=*/false);
          nghttp2_submit_trailer(session_, s.id, t.nv.data(), t.nv.size());
          trailers = session_out_ = true;
          done = true;
        } else if (!s.outbox_waits) {
          done = true;  // all out; the next post's flush puts it back
        }
      }
    }
    if (done) {
      s.sending = false;
      continue;
    }
    if (keep != i) sending_[keep] = std::move(sending_[i]);
    ++keep;
  }
  sending_.resize(keep);
  return trailers;
}

bool H2Connection::SendLocked() {
  for (;;) {
    // Before a TLS handshake ends, frames wait in the session.
    while (io_.ready() && out_.size() - out_off_ < kHighWater) {
      if (session_out_) {
        const uint8_t* data = nullptr;
        const ssize_t n = nghttp2_session_mem_send(session_, &data);
        if (n < 0) return false;
        if (n > 0) {
          out_.append(reinterpret_cast<const char*>(data), static_cast<size_t>(n));
          continue;
        }
        session_out_ = false;
      }
      // nghttp2's frames are whole in out_ (mem_send returns one whole
      // frame per call): ours follow. Trailers they submit go next.
      if (sending_.empty() || !WriteDataLocked()) break;
    }
    if (out_off_ == out_.size() && !io_.pending()) {
      out_.clear();
      out_off_ = 0;
      if (want_write_) {
        want_write_ = false;
        server_->WantWrite(fd_, false);
      }
      return true;
    }
    bool blocked = false;
    const ssize_t w = io_.Write(reinterpret_cast<const uint8_t*>(out_.data()) + out_off_,
                                out_.size() - out_off_, &blocked);
    if (w < 0) return false;
    out_off_ += static_cast<size_t>(w);
    if (!blocked) {
      if (out_off_ == out_.size() && !io_.pending()) {
        out_.clear();
        out_off_ = 0;
        continue;  // more frames may be ready
      }
      if (w == 0) return true;  // TLS takes nothing before the handshake ends
      continue;
    }
    // The socket is full: the event thread goes on when it drains.
    if (!want_write_) {
      want_write_ = true;
      server_->WantWrite(fd_, true);
    }
    return true;
  }
}

// ---- nghttp2 callbacks (mu_ held: inside mem_recv / mem_send).

int H2Connection::OnBeginHeaders(nghttp2_session*, const nghttp2_frame* frame, void* self) {
  auto* c = static_cast<H2Connection*>(self);
  if (frame->hd.type != NGHTTP2_HEADERS || frame->headers.cat != NGHTTP2_HCAT_REQUEST) return 0;
  auto s = std::make_shared<H2Stream>(frame->hd.stream_id);
  s->conn = c->weak_from_this();
  s->send_window = c->initial_window_;
  c->recent_[(static_cast<uint32_t>(s->id) >> 1) % kRecent] = s.get();
  c->streams_[s->id] = std::move(s);
  return 0;
}

int H2Connection::OnHeader(nghttp2_session*, const nghttp2_frame* frame, const uint8_t* name,
                           size_t namelen, const uint8_t* value, size_t valuelen, uint8_t,
                           void* self) {
  auto* c = static_cast<H2Connection*>(self);
  if (frame->hd.type != NGHTTP2_HEADERS || frame->headers.cat != NGHTTP2_HCAT_REQUEST) return 0;
  auto s = c->Find(frame->hd.stream_id);
  if (!s) return 0;
  const std::string_view n(reinterpret_cast<const char*>(name), namelen);
  std::string v(reinterpret_cast<const char*>(value), valuelen);
  if (n == ":method") s->method = std::move(v);
  else if (n == ":path") s->path = std::move(v);
  else if (n == "content-type") s->content_type = std::move(v);
  else if (n == "authorization") s->authorization = std::move(v);
  else if (n == "grpc-timeout") s->grpc_timeout = std::move(v);
  else if (n == "traceparent") s->traceparent = std::move(v);
  return 0;
}

int H2Connection::OnFrameRecv(nghttp2_session*, const nghttp2_frame* frame, void* self) {
  auto* c = static_cast<H2Connection*>(self);
  if (frame->hd.type == NGHTTP2_SETTINGS && (frame->hd.flags & NGHTTP2_FLAG_ACK) == 0) {
    c->established_ = true;  // the client's preface (H2Server's handshake deadline)
    c->OnSettingsLocked();
  }
  if (frame->hd.type != NGHTTP2_HEADERS && frame->hd.type != NGHTTP2_DATA) return 0;
  auto s = c->Find(frame->hd.stream_id);
  if (!s) return 0;
  if (frame->hd.type == NGHTTP2_HEADERS && !s->headers_done) {
    s->headers_done = true;
    OnRequestHeaders(*c, s);
  }
  if ((frame->hd.flags & NGHTTP2_FLAG_END_STREAM) && !s->request_done) {
    s->request_done = true;
    OnRequestComplete(*c, s);
  }
  return 0;
}

int H2Connection::OnDataChunk(nghttp2_session*, uint8_t, int32_t stream_id, const uint8_t* data,
                              size_t len, void* self) {
  auto* c = static_cast<H2Connection*>(self);
  auto s = c->Find(stream_id);
  // A client-streaming method (reflection) takes each message as it
  // completes; the others take one message, and more is an error.
  const bool streaming = s && s->kind == Method::kReflection;
  while (s && !s->answered) {
    if (s->prefix_got < 5) {
      if (len == 0) return 0;
      const size_t take = std::min(len, 5 - s->prefix_got);
      std::memcpy(s->prefix + s->prefix_got, data, take);
      s->prefix_got += take;
      data += take;
      len -= take;
      if (s->prefix_got < 5) return 0;
      OnMessagePrefix(*c, s);
      if (s->answered) return 0;
    }
    const size_t room = s->msg_len - s->body.size();
    const size_t take = std::min(len, room);
    s->body.append(reinterpret_cast<const char*>(data), take);
    data += take;
    len -= take;
    if (!streaming) {
      s->extra_bytes += len;
      return 0;
    }
    if (s->body.size() < s->msg_len) return 0;
    OnStreamMessage(*c, s);
    s->prefix_got = 0;
    s->body.clear();
  }
  return 0;
}

int H2Connection::OnFrameSend(nghttp2_session* session, const nghttp2_frame* frame, void* self) {
  if (frame->hd.type == NGHTTP2_HEADERS && !(frame->hd.flags & NGHTTP2_FLAG_END_STREAM)) {
    // The response HEADERS are in out_ (mem_send returns them with this
    // callback): the stream's DATA may follow them.
    auto s = static_cast<H2Connection*>(self)->Find(frame->hd.stream_id);
    if (s) s->headers_out = true;
    return 0;
  }
  // The response ended before the client finished sending (an early
  // error): the rest of the request is not wanted, as gRPC servers say
  // with RST_STREAM(NO_ERROR). After the HEADERS, so that they arrive.
  if (frame->hd.type != NGHTTP2_HEADERS || !(frame->hd.flags & NGHTTP2_FLAG_END_STREAM)) return 0;
  auto s = static_cast<H2Connection*>(self)->Find(frame->hd.stream_id);
  if (s && !s->request_done) {
    static_cast<H2Connection*>(self)->session_out_ = true;
    nghttp2_submit_rst_stream(session, NGHTTP2_FLAG_NONE, s->id, NGHTTP2_NO_ERROR);
  }
  return 0;
}

int H2Connection::OnStreamClose(nghttp2_session*, int32_t stream_id, uint32_t, void* self) {
  auto* c = static_cast<H2Connection*>(self);
  auto it = c->streams_.find(stream_id);
  if (it == c->streams_.end()) return 0;
  std::shared_ptr<H2Stream> s = std::move(it->second);
  c->streams_.erase(it);
  H2Stream*& slot = c->recent_[(static_cast<uint32_t>(stream_id) >> 1) % kRecent];
  if (slot == s.get()) slot = nullptr;
  s->in_session = false;
  // No stream left to flush a batch: read at once again, so that the
  // client's next (small) request is not left below the low-water mark.
  if (c->streams_.empty()) c->SetLowWaterLocked(1);
  {
    std::lock_guard lock(c->out_mu_);
    s->out_closed = true;
  }
  OnStreamClosed(*s, *c->server_->frontend());
  return 0;
}

}  // namespace tandem::proxy::h2
