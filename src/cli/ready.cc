#include "cli/ready.h"

#include <signal.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

namespace tandem::cli {

void WriteReadyLine(int fd, const std::string& grpc, const std::string& metrics,
                    const std::string& http, const std::string& internal) {
  if (fd < 0) return;
  nlohmann::json j = {{"grpc", grpc}, {"metrics", metrics}};
  if (!http.empty()) j["http"] = http;
  if (!internal.empty()) j["internal"] = internal;
  const std::string line = j.dump() + "\n";
  size_t off = 0;
  while (off < line.size()) {
    const ssize_t n = write(fd, line.data() + off, line.size() - off);
    if (n <= 0) break;
    off += static_cast<size_t>(n);
  }
  close(fd);
}

void BlockTerminationSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

int WaitForTermination() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGHUP);
  int sig = 0;
  sigwait(&set, &sig);
  return sig;
}

}  // namespace tandem::cli
