// StreamWriter's coalescing (common/stream_writer.h, common/token_merge.h)
// over a real gRPC server on loopback: every token reaches the client
// exactly once and in order, whether messages merged or not; only plain
// token messages merge. Asserts tokens and message counts, never timing.
#include "common/stream_writer.h"

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "common/rpc_server.h"
#include "common/token_merge.h"
#include "tandem/v1/generation.grpc.pb.h"
#include "tandem/v1/worker.grpc.pb.h"

namespace tandem {
namespace {

namespace pb = ::tandem::v1;

// Decode streams scripted by the request: prompt_token_ids = {n, mode}.
// mode 0: n one-token chunks queued before Open (so all of them merge);
// mode 1: Open first, then a producer thread writes n one-token chunks as
// fast as it can (merges happen only where the queue is behind).
class DecodeReactor final : public grpc::ServerWriteReactor<pb::DecodeResponse> {
 public:
  using Writer = StreamWriter<pb::DecodeResponse>;
  explicit DecodeReactor(std::shared_ptr<Writer>* out)
      : writer_(std::make_shared<Writer>(this, &MergeDecodeTokens)) {
    *out = writer_;
  }
  void OnWriteDone(bool ok) override { writer_->OnWriteDone(ok); }
  void OnCancel() override { writer_->OnCancel(); }
  void OnDone() override { delete this; }

 private:
  std::shared_ptr<Writer> writer_;
};

pb::DecodeResponse Chunk(uint32_t first, std::vector<uint32_t> ids) {
  pb::DecodeResponse m;
  m.set_request_id("r");
  m.mutable_tokens()->set_first_index(first);
  m.mutable_tokens()->mutable_token_ids()->Add(ids.begin(), ids.end());
  return m;
}

uint32_t TokenAt(uint32_t i) { return 1000 + i * 7; }

class DecodeService final : public pb::Decoder::CallbackService {
 public:
  ~DecodeService() override {
    for (auto& t : threads_) t.join();
  }
  grpc::ServerWriteReactor<pb::DecodeResponse>* Decode(grpc::CallbackServerContext*,
                                                       const pb::DecodeRequest* req) override {
    std::shared_ptr<DecodeReactor::Writer> w;
    auto* r = new DecodeReactor(&w);
    const uint32_t n = req->prompt_token_ids(0);
    pb::DecodeResponse first;
    first.set_request_id("r");
    first.set_registered(true);
    w->Write(std::move(first));
    auto produce = [w, n] {
      for (uint32_t i = 0; i < n; ++i) w->Write(Chunk(i, {TokenAt(i)}));
      pb::DecodeResponse fin;
      fin.set_request_id("r");
      fin.mutable_finished()->set_completion_tokens(n);
      w->Write(std::move(fin));
      w->Finish(grpc::Status::OK);
    };
    {
      std::lock_guard lock(mu_);
      writers_.push_back(w);
    }
    if (req->prompt_token_ids(1) == 0) {
      produce();
      w->Open();
    } else {
      w->Open();
      std::lock_guard lock(mu_);
      threads_.emplace_back(produce);
    }
    return r;
  }
  uint64_t merged(size_t i) {
    std::lock_guard lock(mu_);
    return writers_.at(i)->merged();
  }

 private:
  std::mutex mu_;
  std::vector<std::thread> threads_;
  std::vector<std::shared_ptr<DecodeReactor::Writer>> writers_;
};

struct Received {
  std::vector<pb::DecodeResponse> messages;
  grpc::Status status;
};

Received RunDecode(const std::string& address, uint32_t n, uint32_t mode) {
  auto stub = pb::Decoder::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  pb::DecodeRequest req;
  req.add_prompt_token_ids(n);
  req.add_prompt_token_ids(mode);
  auto reader = stub->Decode(&ctx, req);
  Received out;
  for (pb::DecodeResponse m; reader->Read(&m);) out.messages.push_back(m);
  out.status = reader->Finish();
  return out;
}

// The tokens of `r` in arrival order; checks that each chunk starts where
// the previous one ended.
std::vector<uint32_t> Tokens(const Received& r, size_t* chunks) {
  std::vector<uint32_t> t;
  *chunks = 0;
  for (const auto& m : r.messages) {
    if (m.kind_case() != pb::DecodeResponse::kTokens) continue;
    ++*chunks;
    EXPECT_EQ(m.tokens().first_index(), t.size());
    t.insert(t.end(), m.tokens().token_ids().begin(), m.tokens().token_ids().end());
  }
  return t;
}

std::vector<uint32_t> Expected(uint32_t n) {
  std::vector<uint32_t> v;
  for (uint32_t i = 0; i < n; ++i) v.push_back(TokenAt(i));
  return v;
}

class StreamWriterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto s = RpcServer::Start("127.0.0.1:0", {&service_}, RpcCredentials());
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    server_ = std::move(*s);
  }
  void TearDown() override {
    if (server_) server_->Shutdown();
  }
  DecodeService service_;
  std::unique_ptr<RpcServer> server_;
};

TEST_F(StreamWriterTest, QueuedChunksMergeIntoOneMessageInOrder) {
  const uint32_t n = 500;
  Received r = RunDecode(server_->address(), n, /*mode=*/0);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  // registered, one merged chunk, finished: nothing merges across kinds.
  ASSERT_EQ(r.messages.size(), 3u);
  EXPECT_TRUE(r.messages[0].registered());
  EXPECT_EQ(r.messages[2].finished().completion_tokens(), n);
  size_t chunks = 0;
  EXPECT_EQ(Tokens(r, &chunks), Expected(n));
  EXPECT_EQ(chunks, 1u);
  EXPECT_EQ(service_.merged(0), n - 1);
}

TEST_F(StreamWriterTest, ConcurrentProducerDeliversEveryTokenOnce) {
  const uint32_t n = 20000;
  Received r = RunDecode(server_->address(), n, /*mode=*/1);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  ASSERT_GE(r.messages.size(), 3u);
  EXPECT_TRUE(r.messages.front().registered());
  EXPECT_EQ(r.messages.back().finished().completion_tokens(), n);
  size_t chunks = 0;
  EXPECT_EQ(Tokens(r, &chunks), Expected(n));
  // Every write either became a message or merged into one.
  EXPECT_EQ(chunks + service_.merged(0), n);
}

TEST(TokenMerge, DecodeChunksMergeOnlyWhenContiguous) {
  pb::DecodeResponse a = Chunk(0, {1, 2});
  pb::DecodeResponse gap = Chunk(3, {4});
  EXPECT_FALSE(MergeDecodeTokens(a, gap));
  pb::DecodeResponse next = Chunk(2, {3});
  EXPECT_TRUE(MergeDecodeTokens(a, next));
  EXPECT_EQ(a.tokens().first_index(), 0u);
  EXPECT_EQ(std::vector<uint32_t>(a.tokens().token_ids().begin(), a.tokens().token_ids().end()),
            (std::vector<uint32_t>{1, 2, 3}));
  pb::DecodeResponse fin;
  fin.set_request_id("r");
  fin.mutable_finished()->set_completion_tokens(3);
  EXPECT_FALSE(MergeDecodeTokens(a, fin));
  pb::DecodeResponse other = Chunk(3, {4});
  other.set_request_id("other");
  EXPECT_FALSE(MergeDecodeTokens(a, other));
}

TEST(TokenMerge, GenerateDeltasMergeButNeverTheFinalMessage) {
  pb::GenerateResponse a;
  a.set_request_id("r");
  a.add_token_ids(5);
  a.set_text("he");
  pb::GenerateResponse b;
  b.set_request_id("r");
  b.add_token_ids(6);
  b.set_text("llo");
  EXPECT_TRUE(MergeGenerateDelta(a, b));
  EXPECT_EQ(a.token_ids_size(), 2);
  EXPECT_EQ(a.token_ids(1), 6u);
  EXPECT_EQ(a.text(), "hello");
  pb::GenerateResponse fin;
  fin.set_request_id("r");
  fin.set_finish_reason(pb::FINISH_REASON_LENGTH);
  fin.mutable_usage()->set_completion_tokens(2);
  EXPECT_FALSE(MergeGenerateDelta(a, fin));
  // Nothing merges into a final message either.
  pb::GenerateResponse late = b;
  EXPECT_FALSE(MergeGenerateDelta(fin, late));
}

}  // namespace
}  // namespace tandem
