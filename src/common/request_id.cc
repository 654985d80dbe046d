#include "common/request_id.h"

#include <sys/random.h>

#include <algorithm>
#include <cerrno>

#include "common/check.h"

namespace tandem {
namespace {

bool IsLowerHex(std::string_view s) {
  return std::all_of(s.begin(), s.end(),
                     [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

}  // namespace

std::string RandomHex128() {
  unsigned char bytes[16];
  size_t got = 0;
  while (got < sizeof bytes) {
    const ssize_t n = getrandom(bytes + got, sizeof bytes - got, 0);
    if (n < 0 && errno == EINTR) continue;
    TANDEM_CHECK(n > 0);
    got += static_cast<size_t>(n);
  }
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out(kFleetNonceChars, '0');
  for (size_t i = 0; i < sizeof bytes; ++i) {
    out[2 * i] = kHex[bytes[i] >> 4];
    out[2 * i + 1] = kHex[bytes[i] & 15];
  }
  return out;
}

std::string NewFleetRequestId(std::string_view client_label) {
  std::string nonce = RandomHex128();
  if (client_label.empty()) return nonce;
  std::string id;
  id.reserve(client_label.size() + 1 + nonce.size());
  id.append(client_label);
  id.push_back(kFleetIdSeparator);
  id.append(nonce);
  return id;
}

FleetIdParts SplitFleetRequestId(std::string_view id) {
  if (id.size() == kFleetNonceChars && IsLowerHex(id)) return {id, id};
  if (id.size() > kFleetNonceChars + 1) {
    const size_t at = id.size() - kFleetNonceChars;
    const std::string_view nonce = id.substr(at);
    if (id[at - 1] == kFleetIdSeparator && IsLowerHex(nonce)) {
      return {id.substr(0, at - 1), nonce};
    }
  }
  return {id, {}};
}

}  // namespace tandem
