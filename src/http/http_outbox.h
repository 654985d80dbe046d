// What one HTTP connection sends, in order, from its strand and from the
// request lifecycle's threads (issue 23: the SSE path's cost per token).
//
// A streamed token used to cross threads twice: the lifecycle's sink posted
// it to the connection's strand (waking an Asio I/O thread, ~20 us of CPU on
// these VMs) and the strand wrote it. Now the sink formats the event and,
// when nothing is queued ahead of it, sends it itself: one non-blocking
// send() on the thread that delivered the token, no hand-off, no wake-up.
// Only what the socket does not take at once (a slow reader), and everything
// under TLS, goes through the strand: the bytes queue here and the strand
// writes them with async_write, in order, until none are left.
//
// The socket's descriptor is used only under the mutex and only while the
// Outbox is open; the strand closes the Outbox (Close) before it closes the
// socket, so a sink never writes to a closed or reused descriptor.
//
// Thread-safety: every method from any thread, unless it says "strand".
#pragma once

#include <functional>
#include <mutex>
#include <string>
#include <string_view>

#include "http/sse_encoder.h"

namespace tandem::http {

class Outbox {
 public:
  // `fd`: the plaintext socket's descriptor for direct sends; -1 (TLS):
  // every byte goes through the strand. `start_flush` posts the strand's
  // flush (Session::Flush); `failed` posts the strand's handling of a send
  // that failed (the client went away). Both are called with the lock held
  // and must only post.
  Outbox(int fd, std::function<void()> start_flush, std::function<void()> failed);

  // Sends `bytes` after everything written before.
  void Write(std::string_view bytes);

  // Strand, the flush: moves what waits into `into` (its old bytes are
  // dropped); false when nothing waits, which ends the flush.
  bool TakePending(std::string& into);
  // Bytes wait or a flush is in flight.
  bool Writing();
  // Nothing is written after this: the strand calls it before it closes or
  // shuts down the socket.
  void Close();

  // ---- the generation being answered (one at a time per connection) ----
  // Strand, before the lifecycle starts. `stream`: SSE, `head` its response
  // head (sent with the first event); otherwise the text collects for one
  // JSON body (TakeText).
  void BeginGeneration(bool stream, std::string head, SseEncoder encoder);
  // The lifecycle's sink: new text of the answer.
  void Delta(std::string_view text);
  // Strand, after the lifecycle's last call: the stream's last bytes
  // (`tail`), after the head when no event sent it yet.
  void EndStream(std::string_view tail);
  bool HeadSent();
  std::string TakeText();

 private:
  void WriteLocked(std::string_view bytes);

  std::mutex mu_;
  const int fd_;
  const std::function<void()> start_flush_, failed_;
  bool closed_ = false;    // guarded by mu_
  bool flushing_ = false;  // guarded by mu_; the strand owns the flush while set
  std::string pending_;    // guarded by mu_; bytes the socket has not taken

  // The generation (guarded by mu_).
  bool stream_ = false, head_sent_ = false, first_delta_ = true;
  std::string head_;
  SseEncoder encoder_;
  std::string text_;     // not streamed: the answer's text so far
  std::string scratch_;  // one delta's bytes (reused: no allocation per token)
};

}  // namespace tandem::http
