// A peer name with several addresses, for the framed-connection dial tests
// (frame_conn_test, frame_conn_dial_test): ports on 127.0.0.1 that refuse
// or count the connections made to them, and a lookup (FrameOptions::
// lookup) that answers a name with 127.0.0.1 on each of a list of ports.
#pragma once

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "common/frame_conn.h"

namespace tandem::frame_testing {

// A socket on 127.0.0.1 bound to a free port: listening (non-blocking; it
// counts the connections made to it), with an accept queue of `backlog`,
// or not (a connect to it is refused).
class LocalPort {
 public:
  explicit LocalPort(bool listening, int backlog = 8) {
    fd_ = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(a);
    EXPECT_EQ(bind(fd_, reinterpret_cast<sockaddr*>(&a), len), 0) << std::strerror(errno);
    EXPECT_EQ(getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len), 0);
    port_ = std::to_string(ntohs(a.sin_port));
    if (listening) {
      EXPECT_EQ(listen(fd_, backlog), 0) << std::strerror(errno);
    }
  }
  ~LocalPort() { ::close(fd_); }
  LocalPort(const LocalPort&) = delete;
  LocalPort& operator=(const LocalPort&) = delete;
  const std::string& port() const { return port_; }
  int fd() const { return fd_; }
  // The connections made to it so far (each accepted and closed).
  int Accepted() {
    for (int c; (c = accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC)) >= 0;) {
      ::close(c);
      ++accepted_;
    }
    return accepted_;
  }

 private:
  int fd_ = -1;
  std::string port_;
  int accepted_ = 0;
};

inline std::string PortOf(const std::string& address) { return address.substr(address.rfind(':') + 1); }

// A name with several addresses: the lookup answers 127.0.0.1 on each of
// `ports`, in order, whatever the name and port asked.
struct ManyAddresses {
  static inline std::vector<std::string> ports;
  static int Lookup(const char*, const char*, const addrinfo* hints, addrinfo** res) {
    addrinfo* head = nullptr;
    addrinfo** tail = &head;
    for (const std::string& port : ports) {
      if (int rc = getaddrinfo("127.0.0.1", port.c_str(), hints, tail); rc != 0) {
        if (head != nullptr) freeaddrinfo(head);
        return rc;
      }
      while (*tail != nullptr) tail = &(*tail)->ai_next;
    }
    *res = head;
    return 0;
  }
  static FrameOptions Options(std::vector<std::string> p) {
    ports = std::move(p);
    FrameOptions o;
    o.lookup = &Lookup;
    return o;
  }
};

}  // namespace tandem::frame_testing
