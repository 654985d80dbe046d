// The ready line a process started by `tandem launch` writes once it serves
// (see supervisor.h): one JSON object and a newline on fd --ready-fd.
#pragma once

#include <string>

namespace tandem::cli {

// Writes {"grpc":..,"metrics":..,"http":..,"internal":..} + "\n" to `fd`
// and closes it (empty values are left out). No-op for fd < 0.
void WriteReadyLine(int fd, const std::string& grpc, const std::string& metrics,
                    const std::string& http = "", const std::string& internal = "");

// Blocks SIGINT, SIGTERM and SIGHUP in this thread (call before starting
// other threads, so they inherit the mask) and waits for one; returns its
// number (SIGHUP: the caller reloads and waits again).
int WaitForTermination();
void BlockTerminationSignals();

}  // namespace tandem::cli
