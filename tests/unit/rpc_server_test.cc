// A real gRPC server on loopback: health round trip, reflection present,
// port 0 resolved, and a second server cannot silently share the port.
#include "common/rpc_server.h"

#include <grpc/health/v1/health.grpc.pb.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

namespace tandem {
namespace {

using grpc::health::v1::Health;
using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

HealthCheckResponse::ServingStatus Check(const std::string& address, grpc::Status* status) {
  auto channel = grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
  auto stub = Health::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  HealthCheckRequest req;
  HealthCheckResponse resp;
  *status = stub->Check(&ctx, req, &resp);
  return resp.status();
}

TEST(RpcServer, HealthRoundTripOnLoopback) {
  auto server = RpcServer::Start("127.0.0.1:0", {}, RpcCredentials());
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  EXPECT_GT((*server)->port(), 0);
  grpc::Status st;
  EXPECT_EQ(Check((*server)->address(), &st), HealthCheckResponse::SERVING);
  ASSERT_TRUE(st.ok()) << st.error_message();

  (*server)->SetServing(false);
  EXPECT_EQ(Check((*server)->address(), &st), HealthCheckResponse::NOT_SERVING);
  ASSERT_TRUE(st.ok());
}

TEST(RpcServer, PortIsNotShared) {
  auto first = RpcServer::Start("127.0.0.1:0", {}, RpcCredentials());
  ASSERT_TRUE(first.ok());
  auto second = RpcServer::Start((*first)->address(), {}, RpcCredentials());
  ASSERT_FALSE(second.ok()) << "SO_REUSEPORT must be off: a second server bound the same port";
  EXPECT_EQ(second.status().code(), StatusCode::kUnavailable);
}

TEST(RpcServer, StatusMappingRoundTrips) {
  const Status s = ResourceExhaustedError("queue full: 256 requests waiting; limit 256");
  const grpc::Status g = ToGrpcStatus(s);
  EXPECT_EQ(g.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(g.error_message(), s.message());
  EXPECT_EQ(FromGrpcStatus(g), s);
  EXPECT_TRUE(ToGrpcStatus(Status::Ok()).ok());
}

}  // namespace
}  // namespace tandem
