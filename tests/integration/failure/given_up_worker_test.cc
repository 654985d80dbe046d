// A worker the proxy gave up (docs/failure-handling.md, "Liveness"): its
// Watch went silent for the liveness timeout, so the proxy took it out of
// routing and ended its calls in flight (GrpcWorkerClient::AbandonCalls).
// A request routed to it just before that moment still starts calls to it
// afterwards: its Prefill only once the decoder registered it, its Decode
// once the route is made. A stopped process keeps its ports open and never
// answers, so such a call waited for the request's deadline (30 s) when
// the worker stayed stopped. Calls started to a given-up address now end at
// once with the abandon reason (the lifecycle retries them elsewhere),
// until the worker answers again (GrpcWorkerClient::Reachable).
//
// The worker here is a listening socket that never accepts: the kernel
// completes TCP handshakes into its backlog and nothing ever answers, as
// with a SIGSTOPped worker. Real gRPC channels and calls, no fleet.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "common/tls.h"
#include "proxy/worker_client_grpc.h"

namespace tandem::proxy {
namespace {

using namespace std::chrono_literals;

class SilentPort {
 public:
  SilentPort() {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(a);
    if (bind(fd_, reinterpret_cast<sockaddr*>(&a), len) != 0 || listen(fd_, 16) != 0 ||
        getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
      ADD_FAILURE() << "cannot listen on 127.0.0.1";
    }
    address_ = "127.0.0.1:" + std::to_string(ntohs(a.sin_port));
  }
  ~SilentPort() { close(fd_); }
  const std::string& address() const { return address_; }

 private:
  int fd_ = -1;
  std::string address_;
};

PromptIds Prompt() { return std::make_shared<const std::vector<uint32_t>>(std::vector<uint32_t>{1, 2, 3}); }

// Starts a Prefill to `address` with `deadline`; the future gets its status.
std::future<Status> StartPrefill(GrpcWorkerClient& client, const std::string& address,
                                 std::chrono::system_clock::time_point deadline,
                                 std::shared_ptr<Call>* call) {
  auto done = std::make_shared<std::promise<Status>>();
  std::future<Status> f = done->get_future();
  PrefillArgs a;
  a.request_id = "given-up";
  a.prompt_ids = Prompt();
  a.deadline = deadline;
  a.decoder_address = "127.0.0.1:1";
  a.decoder_name = "decode-0";
  a.attempt = 1;
  *call = client.Prefill(address, std::move(a),
                         [done](Result<PrefillResult> r) { done->set_value(r.status()); });
  return f;
}

// Starts a Decode to `address`; the future gets the status of its end
// (on_error) and whether the worker sent it (from_worker).
std::future<std::pair<Status, bool>> StartDecode(GrpcWorkerClient& client,
                                                 const std::string& address,
                                                 std::chrono::system_clock::time_point deadline,
                                                 std::shared_ptr<Call>* call) {
  auto done = std::make_shared<std::promise<std::pair<Status, bool>>>();
  std::future<std::pair<Status, bool>> f = done->get_future();
  DecodeArgs a;
  a.request_id = "given-up";
  a.prompt_ids = Prompt();
  a.params.max_tokens = 4;
  a.deadline = deadline;
  a.attempt = 1;
  DecodeEvents ev;
  ev.on_finished = [done](Finish, uint32_t, uint32_t, uint32_t) {
    done->set_value({InternalError("finished"), true});
  };
  ev.on_error = [done](Status st, bool from_worker) { done->set_value({st, from_worker}); };
  *call = client.Decode(address, std::move(a), std::move(ev));
  return f;
}

// A call started after AbandonCalls ends at once with the abandon reason
// (the lifecycle then retries the request on another worker). Before, the
// Prefill waited for its deadline (DEADLINE_EXCEEDED after 20 s here) and
// the Decode over the decode stream for ever (it has no deadline of its
// own at the proxy; the bounded wait below gives up).
TEST(Failure, CallsToAWorkerGivenUpEndAtOnceUntilItAnswersAgain) {
  SilentPort worker;
  for (bool decode_stream : {true, false}) {
    SCOPED_TRACE(decode_stream ? "decode stream" : "Decode RPC");
    GrpcWorkerClient client(RpcCredentials(), decode_stream, /*decode_tcp=*/false);
    client.SetDecodeStream(worker.address(), decode_stream);
    const std::string why = "worker 'w-0' stopped answering (no update for 1000 ms)";
    EXPECT_EQ(client.AbandonCalls(worker.address(), why), 0u);  // nothing was in flight

    const auto deadline = std::chrono::system_clock::now() + 20s;
    std::shared_ptr<Call> prefill, decode;
    auto p = StartPrefill(client, worker.address(), deadline, &prefill);
    auto d = StartDecode(client, worker.address(), deadline, &decode);
    ASSERT_EQ(p.wait_for(25s), std::future_status::ready);
    const Status ps = p.get();
    EXPECT_EQ(ps.code(), StatusCode::kUnavailable) << ps.ToString();
    EXPECT_EQ(ps.message(), why);
    ASSERT_EQ(d.wait_for(25s), std::future_status::ready) << "the Decode call never ended";
    const auto [ds, from_worker] = d.get();
    EXPECT_EQ(ds.code(), StatusCode::kUnavailable) << ds.ToString();
    EXPECT_EQ(ds.message(), why);
    EXPECT_FALSE(from_worker);  // as a lost worker: the lifecycle retries it elsewhere

    // The worker answers again (a probe's snapshot, or its registration):
    // calls to it are made again. This one reaches the silent port and ends
    // only with its own deadline, not with the old abandon reason.
    client.Reachable(worker.address());
    auto again = StartPrefill(client, worker.address(),
                              std::chrono::system_clock::now() + 300ms, &prefill);
    ASSERT_EQ(again.wait_for(25s), std::future_status::ready);
    EXPECT_EQ(again.get().code(), StatusCode::kDeadlineExceeded);
  }
}

}  // namespace
}  // namespace tandem::proxy
