#include "proxy/prefill_tcp_client.h"

#include <fmt/format.h>

#include <algorithm>

#include "common/delivery_scope.h"
#include "common/frame_loop.h"
#include "proxy/prompt_parts.h"
#include "tandem/v1/worker.pb.h"

namespace tandem::proxy {

namespace pb = ::tandem::v1;
using SteadyClock = std::chrono::steady_clock;

void PrefillTcpCall::Cancel() {
  if (auto c = client_.lock()) c->CancelCall(*this);
}

PrefillTcpClient::PrefillTcpClient(std::shared_ptr<FrameConn> conn)
    : conn_(std::move(conn)), reader_until_(SteadyClock::time_point::max()), reader_(conn_, &FrameLoop::Shared()) {}

PrefillTcpClient::~PrefillTcpClient() = default;

bool PrefillRequestInParts(const PrefillArgs& args, uint64_t timeout_us, PrefillRequestParts* out) {
  const PackedPrompt prompt =
      PromptForParts(args.prompt_ids, args.prompt_varints, args.prompt_fixed32);
  if (prompt.bytes.empty()) return false;
  pb::PrefillFrame outer;  // the frame's own small fields
  if (timeout_us != 0) outer.set_timeout_us(timeout_us);
  if (!args.traceparent.empty()) outer.set_traceparent(args.traceparent);
  pb::PrefillRequest req;
  FillPrefillRequestFields(args, &req);
  std::string& head = out->head;
  head.clear();
  outer.AppendToString(&head);
  AppendPromptMessageField(pb::PrefillFrame::kRequestFieldNumber, req,
                           prompt.varints ? pb::PrefillRequest::kPromptTokenIdsFieldNumber
                                          : pb::PrefillRequest::kPromptTokenIdsFixed32FieldNumber,
                           prompt.bytes.size(), &head);
  out->prompt = prompt.bytes;
  return true;
}

std::string PrefillCallIdField(uint64_t call_id) {
  std::string out;
  AppendVarintFieldTag(pb::PrefillFrame::kCallIdFieldNumber, &out);
  AppendVarint(call_id, &out);
  return out;
}

std::shared_ptr<PrefillTcpClient> PrefillTcpClient::Open(const std::string& address,
                                                         std::shared_ptr<FrameTls> tls,
                                                         FrameOptions options) {
  auto c = std::make_shared<PrefillTcpClient>(FrameConn::Client(address, std::move(tls), options));
  PrefillTcpClient* p = c.get();
  FrameReader::Hooks hooks;
  hooks.on_frame = [p](std::string_view payload) { return p->OnFrame(payload, p->done_); };
  hooks.before_wait = [p] { return p->BeforeWait(); };
  hooks.after_progress = [p] { p->AfterProgress(); };
  hooks.on_end = [p](const Status& why) { p->OnEnd(why); };
  p->reader_.Start("prefill-tcp-rd", std::move(hooks), c);
  return c;
}

bool PrefillTcpClient::ended() const {
  std::lock_guard lock(mu_);
  return ended_;
}

size_t PrefillTcpClient::num_calls() const {
  std::lock_guard lock(mu_);
  return calls_.size();
}

void PrefillTcpClient::Stop() {
  conn_->Close(UnavailableError("the proxy is stopping"));
  reader_.Wake();
  reader_.Join();
}

std::shared_ptr<PrefillTcpCall> PrefillTcpClient::Start(
    const PrefillArgs& args, std::function<void(Result<PrefillResult>)> done) {
  // Built outside the lock. The prompt is copied once, straight into the
  // connection's output (PrefillRequestInParts), or, for a worker that reads
  // the varint field, into the message and then into the output.
  uint64_t timeout_us = 0;
  auto deadline = SteadyClock::time_point::max();
  if (args.deadline != std::chrono::system_clock::time_point::max()) {
    // As gRPC's grpc-timeout: the time left, which the prefiller applies on
    // its own clock (at least 1 µs: an expired deadline still expires there).
    const auto left = std::chrono::duration_cast<std::chrono::microseconds>(
        args.deadline - std::chrono::system_clock::now());
    timeout_us = static_cast<uint64_t>(std::max<int64_t>(1, left.count()));
    deadline = SteadyClock::now() + left;
  }
  PrefillRequestParts parts;
  pb::PrefillFrame frame;
  const bool in_parts = PrefillRequestInParts(args, timeout_us, &parts);
  if (!in_parts) {
    FillPrefillRequest(args, frame.mutable_request());
    if (!args.traceparent.empty()) frame.set_traceparent(args.traceparent);
    if (timeout_us != 0) frame.set_timeout_us(timeout_us);
  }
  bool wake = false;
  auto wake_by = SteadyClock::time_point::max();
  std::shared_ptr<PrefillTcpCall> call;
  {
    std::lock_guard lock(mu_);
    if (ended_) return nullptr;
    const uint64_t id = next_id_++;
    call = std::make_shared<PrefillTcpCall>(weak_from_this(), id, std::move(done));
    call->deadline_ = deadline;
    // Under mu_: a call's request always leaves before its cancel.
    Status st = Status::Ok();
    if (in_parts) {
      st = conn_->SendParts({PrefillCallIdField(id), parts.head, parts.prompt});
    } else {
      frame.set_call_id(id);
      st = conn_->Send(frame);
    }
    if (!st.ok() && st.code() == StatusCode::kInvalidArgument) {
      posted_.emplace_back(call, std::move(st));  // over the frame limit: this call fails
      wake = true;
    } else {
      if (!st.ok()) {
        conn_->Close(st);  // the reader ends every call, this one too
        wake = true;
      }
      calls_.emplace(id, call);
      if (deadline != SteadyClock::time_point::max()) {
        deadlines_.emplace(deadline, id);
        if (deadline < reader_until_) wake_by = reader_until_ = deadline;
      }
    }
  }
  // A deadline earlier than the reader's wait is the only reason to tell
  // the reader about the call: it is told without being woken (WakeBy).
  if (wake) {
    reader_.Wake();
  } else if (wake_by != SteadyClock::time_point::max()) {
    reader_.WakeBy(wake_by);
  }
  return call;
}

std::shared_ptr<PrefillTcpCall> PrefillTcpClient::TakeLocked(uint64_t id) {
  auto it = calls_.find(id);
  if (it == calls_.end()) return nullptr;
  std::shared_ptr<PrefillTcpCall> call = std::move(it->second);
  calls_.erase(it);
  if (call->deadline_ != SteadyClock::time_point::max()) deadlines_.erase({call->deadline_, id});
  return call;
}

void PrefillTcpClient::CancelCall(PrefillTcpCall& c) {
  bool wake = false;
  {
    std::lock_guard lock(mu_);
    std::shared_ptr<PrefillTcpCall> call = TakeLocked(c.id_);
    if (!call) return;  // over already
    pb::PrefillFrame frame;
    frame.set_call_id(c.id_);
    frame.set_cancel(true);
    if (Status st = conn_->Send(frame); !st.ok()) conn_->Close(st);
    // As gRPC's TryCancel: `done` still runs once, later, on the reader.
    posted_.emplace_back(std::move(call), CancelledError("Cancelled"));
    wake = true;
  }
  if (wake) reader_.Wake();
}

void PrefillTcpClient::ExpireLocked(SteadyClock::time_point now, std::vector<Completion>& out) {
  while (!deadlines_.empty() && deadlines_.begin()->first <= now) {
    const uint64_t id = deadlines_.begin()->second;
    std::shared_ptr<PrefillTcpCall> call = TakeLocked(id);
    pb::PrefillFrame frame;
    frame.set_call_id(id);
    frame.set_cancel(true);  // the prefiller expires it too; this stops it at once
    if (Status st = conn_->Send(frame); !st.ok()) conn_->Close(st);
    out.emplace_back(std::move(call), DeadlineExceededError("Deadline Exceeded"));
  }
}

Status PrefillTcpClient::OnFrame(std::string_view payload, std::vector<Completion>& out) {
  pb::PrefillFrame frame;
  if (!frame.ParseFromArray(payload.data(), static_cast<int>(payload.size()))) {
    return InvalidArgumentError("a prefill frame does not hold a PrefillFrame");
  }
  std::shared_ptr<PrefillTcpCall> call;
  {
    std::lock_guard lock(mu_);
    call = TakeLocked(frame.call_id());
  }
  if (!call) return Status::Ok();  // cancelled or expired here first
  switch (frame.kind_case()) {
    case pb::PrefillFrame::kResponse:
      out.emplace_back(std::move(call), ToPrefillResult(frame.response()));
      return Status::Ok();
    case pb::PrefillFrame::kError: {
      const int code = frame.error().code();
      const StatusCode c =
          code > 0 && code <= 16 ? static_cast<StatusCode>(code) : StatusCode::kUnknown;
      out.emplace_back(std::move(call), Status(c, frame.error().message()));
      return Status::Ok();
    }
    default: {
      Status st = InvalidArgumentError(
          fmt::format("prefill frame of call {}: neither a response nor an error", frame.call_id()));
      out.emplace_back(std::move(call), UnavailableError(st.message()));
      return st;
    }
  }
}

void PrefillTcpClient::Complete(std::vector<Completion>& done) {
  for (auto& [call, result] : done) {
    auto fn = std::move(call->done_);
    if (!fn) continue;
    if (const std::string why = call->abandoned(); !why.empty()) {
      fn(UnavailableError(why));  // the proxy's liveness check gave the worker up
    } else {
      fn(std::move(result));
    }
  }
  done.clear();
}

SteadyClock::time_point PrefillTcpClient::BeforeWait() {
  for (;;) {
    auto until = SteadyClock::time_point::max();
    {
      std::lock_guard lock(mu_);
      ExpireLocked(SteadyClock::now(), done_);
      for (auto& c : posted_) done_.push_back(std::move(c));
      posted_.clear();
      if (!deadlines_.empty()) until = deadlines_.begin()->first;
      reader_until_ = done_.empty() ? until : SteadyClock::time_point::min();
    }
    if (done_.empty()) return until;
    DeliveryScope scope;  // the native front end flushes once, at its end
    Complete(done_);
  }
}

void PrefillTcpClient::AfterProgress() {
  DeliveryScope scope;
  Complete(done_);
}

void PrefillTcpClient::OnEnd(const Status& why) {
  // Every call still open ends as on a broken channel (after the replies
  // read before the break, delivered by AfterProgress).
  const Status broken =
      UnavailableError(fmt::format("prefill connection to {} broken: {}", conn_->peer(), why.message()));
  {
    std::lock_guard lock(mu_);
    ended_ = true;
    for (auto& c : posted_) done_.push_back(std::move(c));
    posted_.clear();
    for (auto& [id, call] : calls_) done_.emplace_back(std::move(call), broken);
    calls_.clear();
    deadlines_.clear();
  }
  DeliveryScope scope;
  Complete(done_);
}

}  // namespace tandem::proxy
