#include "proxy/watch_tcp_client.h"

#include <fmt/format.h>

#include "common/frame_loop.h"

namespace tandem::proxy {

namespace pb = ::tandem::v1;

namespace {
google::protobuf::ArenaOptions BlockOptions(char* block) {
  google::protobuf::ArenaOptions o;
  o.initial_block = block;
  o.initial_block_size = WorkerUpdateParser::kBlockBytes;
  return o;
}
}  // namespace

WorkerUpdateParser::WorkerUpdateParser()
    : block_(new char[kBlockBytes]), arena_(BlockOptions(block_.get())) {}

const pb::WorkerUpdate* WorkerUpdateParser::Parse(std::string_view payload) {
  // The previous updates go once the frames parsed since the last reset
  // add up to a quarter of the first block (their messages take about
  // twice their wire size at most): a Reset costs about as much as the
  // mallocs it saves, so not one per frame (a Watch batch of an 8k prompt
  // is ~4 kB). Counted here: Arena::SpaceUsed walks the arena's blocks.
  if (parsed_bytes_ > kBlockBytes / 4) {
    arena_.Reset();  // the first block stays
    parsed_bytes_ = 0;
  }
  parsed_bytes_ += payload.size();
  auto* u = google::protobuf::Arena::CreateMessage<pb::WorkerUpdate>(&arena_);
  if (!u->ParseFromArray(payload.data(), static_cast<int>(payload.size()))) return nullptr;
  return u;
}

WatchTcpClient::WatchTcpClient(std::shared_ptr<FrameConn> conn, pb::WatchRequest request)
    : conn_(std::move(conn)), request_(std::move(request)), reader_(conn_, &FrameLoop::Shared()) {}

WatchTcpClient::~WatchTcpClient() = default;

std::shared_ptr<WatchTcpClient> WatchTcpClient::Create(const std::string& address,
                                                       std::shared_ptr<FrameTls> tls,
                                                       pb::WatchRequest request,
                                                       FrameOptions options) {
  return std::make_shared<WatchTcpClient>(FrameConn::Client(address, std::move(tls), options),
                                          std::move(request));
}

void WatchTcpClient::Start(Callbacks callbacks) {
  if (reader_.started()) return;
  callbacks_ = std::move(callbacks);
  // The request first: queued until the connection is authenticated, then
  // flushed. A failure ends the watch (the reader's Connect returns it).
  if (Status st = conn_->Send(request_); !st.ok()) conn_->Close(st);
  FrameReader::Hooks hooks;
  hooks.on_frame = [this](std::string_view payload) { return OnFrame(payload); };
  hooks.on_end = [this](const Status& why) { OnEnd(why); };
  // The reader keeps this object alive until it ends: a handle's owner may
  // drop its reference from on_end.
  reader_.Start("watch-tcp-read", std::move(hooks), shared_from_this());
}

void WatchTcpClient::Stop(const Status& why) {
  stopped_.store(true);
  conn_->Close(why);
  reader_.Wake();
}

Status WatchTcpClient::OnFrame(std::string_view payload) {
  if (stopped_.load()) return CancelledError("watch stopped");
  if (callbacks_.on_batch && ParseWatchBatch(payload, batch_)) {
    callbacks_.on_batch(batch_);
    return Status::Ok();
  }
  const pb::WorkerUpdate* update = parser_.Parse(payload);
  if (update == nullptr) return InvalidArgumentError("a Watch frame does not hold a WorkerUpdate");
  if (update->watch_ended()) {
    graceful_ = true;
    return UnavailableError("the worker ended the watch");
  }
  callbacks_.on_update(*update);
  return Status::Ok();
}

void WatchTcpClient::OnEnd(const Status& why) {
  callbacks_.on_end(graceful_ && !stopped_.load(),
                    graceful_ ? why
                              : UnavailableError(fmt::format("watch connection to {}: {}",
                                                             conn_->peer(), why.message())));
  callbacks_ = {};
}

}  // namespace tandem::proxy
