// The launcher's autoscaler against the planners of several proxy replicas:
// the number it follows (the largest any replica wants) and a replica that
// cannot be read (down, or restarting) stopping nothing. The whole loop on a
// real fleet is tests/integration/sim/autoscale_fleet_test.cc.
#include "cli/autoscaler.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <thread>
#include <vector>

namespace tandem::cli {
namespace {

std::string Planner(int decode, int prefill) {
  return fmt::format(
      "# TYPE tandem_planner_desired_workers gauge\n"
      "tandem_planner_desired_workers{{role=\"decode\"}} {}\n"
      "tandem_planner_desired_workers{{role=\"prefill\"}} {}\n",
      decode, prefill);
}

TEST(Autoscaler, FollowsTheLargestCountAnyReplicaWants) {
  EXPECT_EQ(DesiredAcrossReplicas({Planner(2, 1), Planner(3, 1), Planner(1, 4)}, "decode"), 3u);
  EXPECT_EQ(DesiredAcrossReplicas({Planner(2, 1), Planner(3, 1), Planner(1, 4)}, "prefill"), 4u);
  // 0: that replica's planner is off or has not decided (a restarted one).
  EXPECT_EQ(DesiredAcrossReplicas({Planner(0, 0), Planner(2, 0)}, "decode"), 2u);
  EXPECT_EQ(DesiredAcrossReplicas({Planner(0, 0), Planner(2, 0)}, "prefill"), std::nullopt);
  EXPECT_EQ(DesiredAcrossReplicas({"", "tandem_other 3\n"}, "decode"), std::nullopt);
  EXPECT_EQ(DesiredAcrossReplicas({}, "decode"), std::nullopt);
}

// A loopback /metrics endpoint that answers `body` to every request until
// destroyed.
class FakeMetrics {
 public:
  explicit FakeMetrics(std::string body) : body_(std::move(body)) {
    fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(sa);
    EXPECT_EQ(bind(fd_, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)), 0);
    EXPECT_EQ(listen(fd_, 8), 0);
    getsockname(fd_, reinterpret_cast<sockaddr*>(&sa), &len);
    address_ = fmt::format("127.0.0.1:{}", ntohs(sa.sin_port));
    thread_ = std::thread([this] {
      while (true) {
        const int c = accept(fd_, nullptr, nullptr);
        if (c < 0) return;  // shut down
        char buf[1024];
        (void)read(c, buf, sizeof(buf));  // one small GET
        const std::string resp = "HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\n" + body_;
        (void)write(c, resp.data(), resp.size());
        close(c);
      }
    });
  }
  ~FakeMetrics() {
    shutdown(fd_, SHUT_RDWR);
    thread_.join();
    close(fd_);
  }
  const std::string& address() const { return address_; }

 private:
  std::string body_;
  int fd_ = -1;
  std::string address_;
  std::thread thread_;
};

// An address nothing listens on (connection refused at once).
std::string ClosedAddress() {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(sa);
  bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa));
  getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len);
  close(fd);
  return fmt::format("127.0.0.1:{}", ntohs(sa.sin_port));
}

TEST(Autoscaler, AReplicaThatIsDownStopsNothing) {
  FakeMetrics replica1(Planner(2, 3));
  AutoscaleConfig config;
  config.enabled = true;
  Supervisor sup;  // no workers yet: every wanted one is missing
  std::vector<std::string> started;
  Autoscaler scaler(
      config, {ClosedAddress(), replica1.address()}, &sup,
      [&](const std::string& role, uint32_t index) {
        started.push_back(fmt::format("{}-{}", role, index));
        return Status::Ok();
      },
      {{"decode", 1}, {"prefill", 1}});
  EXPECT_TRUE(scaler.Poll());
  // At most one worker per role per poll, numbered after the fleet file's.
  EXPECT_EQ(started, (std::vector<std::string>{"decode-1", "prefill-1"}));
}

TEST(Autoscaler, NoReplicaReadableChangesNothing) {
  AutoscaleConfig config;
  config.enabled = true;
  Supervisor sup;
  int starts = 0;
  Autoscaler scaler(
      config, {ClosedAddress(), ClosedAddress()}, &sup,
      [&](const std::string&, uint32_t) {
        ++starts;
        return Status::Ok();
      },
      {{"decode", 1}, {"prefill", 1}});
  EXPECT_FALSE(scaler.Poll());
  EXPECT_EQ(starts, 0);
}

// One decoder serving (a /bin/sh stand-in with a ready line, as in
// supervisor_test): replica 0 is content with it, replica 1 wants two.
TEST(Autoscaler, ALargerCountOnAnotherReplicaWins) {
  using namespace std::chrono_literals;
  FakeMetrics replica0(Planner(1, 1)), replica1(Planner(2, 1));
  AutoscaleConfig config;
  config.enabled = true;
  Supervisor sup;
  const std::string ready =
      "printf '{\"grpc\":\"127.0.0.1:1\",\"metrics\":\"127.0.0.1:2\"}\\n' >\"/proc/self/fd/$2\"; "
      "exec sleep 30";
  for (const char* role : {"decode", "prefill"}) {
    auto c = sup.Start({fmt::format("{}-0", role), role, {"/bin/sh", "-c", ready, "sh"}}, 10s);
    ASSERT_TRUE(c.ok()) << c.status().ToString();
  }
  std::vector<std::string> started;
  auto start = [&](const std::string& role, uint32_t index) {
    started.push_back(fmt::format("{}-{}", role, index));
    return Status::Ok();
  };
  Autoscaler only0(config, {replica0.address()}, &sup, start, {{"decode", 1}, {"prefill", 1}});
  EXPECT_FALSE(only0.Poll());  // replica 0 alone: one of each is right
  EXPECT_TRUE(started.empty());
  Autoscaler both(config, {replica0.address(), replica1.address()}, &sup, start,
                  {{"decode", 1}, {"prefill", 1}});
  EXPECT_TRUE(both.Poll());
  EXPECT_EQ(started, (std::vector<std::string>{"decode-1"}));
  EXPECT_EQ(sup.StopAll(5s), 0);
}

}  // namespace
}  // namespace tandem::cli
