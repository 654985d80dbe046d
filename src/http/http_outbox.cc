#include "http/http_outbox.h"

#include <sys/socket.h>
#include <sys/types.h>

#include <cerrno>

namespace tandem::http {

Outbox::Outbox(int fd, std::function<void()> start_flush, std::function<void()> failed)
    : fd_(fd), start_flush_(std::move(start_flush)), failed_(std::move(failed)) {}

void Outbox::Write(std::string_view bytes) {
  std::lock_guard lock(mu_);
  WriteLocked(bytes);
}

void Outbox::WriteLocked(std::string_view bytes) {
  if (closed_ || bytes.empty()) return;
  if (!flushing_ && fd_ >= 0) {
    // Nothing queued ahead: straight to the socket, from this thread.
    const ssize_t n = ::send(fd_, bytes.data(), bytes.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n == static_cast<ssize_t>(bytes.size())) return;
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
      closed_ = true;  // reset or closed by the client: the strand cancels
      pending_.clear();
      failed_();
      return;
    }
    bytes.remove_prefix(n > 0 ? static_cast<size_t>(n) : 0);
  }
  pending_.append(bytes);
  if (!flushing_) {
    flushing_ = true;
    start_flush_();
  }
}

bool Outbox::TakePending(std::string& into) {
  std::lock_guard lock(mu_);
  into.clear();
  if (closed_ || pending_.empty()) {
    flushing_ = false;
    return false;
  }
  into.swap(pending_);
  return true;
}

bool Outbox::Writing() {
  std::lock_guard lock(mu_);
  return flushing_ || !pending_.empty();
}

void Outbox::Close() {
  std::lock_guard lock(mu_);
  closed_ = true;
  pending_.clear();
  pending_.shrink_to_fit();
}

void Outbox::BeginGeneration(bool stream, std::string head, SseEncoder encoder) {
  std::lock_guard lock(mu_);
  stream_ = stream;
  head_sent_ = false;
  first_delta_ = true;
  head_ = std::move(head);
  encoder_ = std::move(encoder);
  text_.clear();
}

void Outbox::Delta(std::string_view text) {
  std::lock_guard lock(mu_);
  if (closed_) return;
  if (!stream_) {
    text_.append(text);
    return;
  }
  scratch_.clear();
  if (!head_sent_) {
    head_sent_ = true;
    scratch_.append(head_);
  }
  if (!text.empty()) {
    encoder_.AppendDelta(scratch_, text, first_delta_);
    first_delta_ = false;
  }
  WriteLocked(scratch_);
}

void Outbox::EndStream(std::string_view tail) {
  std::lock_guard lock(mu_);
  scratch_.clear();
  if (!head_sent_) {
    head_sent_ = true;
    scratch_.append(head_);
  }
  scratch_.append(tail);
  WriteLocked(scratch_);
}

bool Outbox::HeadSent() {
  std::lock_guard lock(mu_);
  return head_sent_;
}

std::string Outbox::TakeText() {
  std::lock_guard lock(mu_);
  return std::move(text_);
}

}  // namespace tandem::http
