#include "kvtransfer/kv_secret.h"

#include <sys/random.h>

#include <cerrno>
#include <cstring>

#include <fmt/format.h>

namespace tandem::kvtransfer {

Result<std::string> RandomBytes(size_t n) {
  std::string out(n, '\0');
  size_t done = 0;
  while (done < n) {
    const ssize_t got = getrandom(out.data() + done, n - done, 0);
    if (got < 0) {
      if (errno == EINTR) continue;
      return InternalError(fmt::format("getrandom failed: {}", std::strerror(errno)));
    }
    done += static_cast<size_t>(got);
  }
  return out;
}

Result<std::string> NewCapability() { return RandomBytes(kCapabilityBytes); }

Result<uint64_t> RandomNonZeroU64() {
  for (;;) {
    TANDEM_ASSIGN_OR_RETURN(std::string b, RandomBytes(sizeof(uint64_t)));
    uint64_t v = 0;
    std::memcpy(&v, b.data(), sizeof(v));
    if (v != 0) return v;
  }
}

bool SecretEquals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  }
  // Keep the compiler from turning the loop into an early exit.
  volatile unsigned char sink = diff;
  return sink == 0;
}

}  // namespace tandem::kvtransfer
