// The worker client destroyed just after a call's callback (session 51).
//
// With gRPC 1.51 on epoll1 the callbacks of a client's calls run on the
// process-wide callback queue's threads, which live while a channel that
// made a callback call lives. A unary call's callback functor, holding the
// call (its stub and context, so its channel), is destroyed on such a
// thread just after the callback returns; if the client and its channels
// were gone by then, that destruction dropped the process's last channel
// there, and gRPC's release of the queue joined that thread from itself
// and freed the queue under it: a later `assertion failed: prior > 0` and
// an abort (seen once in CI in given_up_worker_test, at the process's
// exit). GrpcWorkerClient now waits for its reactors before its channels go
// (proxy/reactor_drain.h). This test destroys a client right after each of
// many calls' callbacks, each client the process's only channel, so that
// every round puts the last reference where the race was.
//
// Real gRPC: each Prefill goes to a port nobody listens on (refused at
// once); no fleet.
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

// A loopback port that was just free: connections to it are refused.
std::string RefusingAddress() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), len) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    ADD_FAILURE() << "cannot bind 127.0.0.1";
  }
  close(fd);
  return "127.0.0.1:" + std::to_string(ntohs(a.sin_port));
}

TEST(ClientTeardown, ClientGoneRightAfterEachCallbackLeavesGrpcIntact) {
  const std::string address = RefusingAddress();
  constexpr int kRounds = 300;
  int unavailable = 0;
  for (int round = 0; round < kRounds; ++round) {
    auto client = std::make_unique<GrpcWorkerClient>(RpcCredentials(), /*decode_stream=*/false,
                                                     /*decode_tcp=*/false);
    std::promise<Status> done;
    std::future<Status> ended = done.get_future();
    PrefillArgs a;
    a.request_id = "teardown-" + std::to_string(round);
    a.prompt_ids = std::make_shared<const std::vector<uint32_t>>(std::vector<uint32_t>{1, 2, 3});
    a.deadline = std::chrono::system_clock::now() + 20s;
    a.decoder_address = "127.0.0.1:1";
    a.decoder_name = "decode-0";
    a.attempt = 1;
    client->Prefill(address, std::move(a),
                    [&done](Result<PrefillResult> r) { done.set_value(r.status()); });
    ASSERT_EQ(ended.wait_for(30s), std::future_status::ready) << "round " << round;
    const Status st = ended.get();
    if (st.code() == StatusCode::kUnavailable) ++unavailable;
    client.reset();  // at once: the call's functor may still be on its way out
  }
  EXPECT_EQ(unavailable, kRounds);  // every call reached the refused port and ended so
}

}  // namespace
}  // namespace tandem::proxy
