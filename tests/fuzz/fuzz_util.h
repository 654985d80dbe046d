// Helpers shared by the libFuzzer targets (tests/fuzz, docs/security.md).
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

namespace tandem::fuzz {

// The input as a file the code under test opens by path (an in-memory file,
// /proc/self/fd/N, closed when this goes out of scope).
class MemFile {
 public:
  MemFile(const uint8_t* data, size_t size, const char* name) {
    fd_ = memfd_create(name, MFD_CLOEXEC);
    if (fd_ < 0) std::abort();
    size_t done = 0;
    while (done < size) {
      const ssize_t n = write(fd_, data + done, size - done);
      if (n <= 0) std::abort();
      done += static_cast<size_t>(n);
    }
    path_ = "/proc/self/fd/" + std::to_string(fd_);
  }
  ~MemFile() { close(fd_); }
  MemFile(const MemFile&) = delete;
  MemFile& operator=(const MemFile&) = delete;
  const std::string& path() const { return path_; }

 private:
  int fd_ = -1;
  std::string path_;
};

// Quiets spdlog (parsers may log warnings) once per process.
void QuietLogs();

}  // namespace tandem::fuzz
