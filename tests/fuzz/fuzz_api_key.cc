// libFuzzer target: the API key check of both public front ends
// (proxy/tenants.cc, Tenants::Authenticate: the `authorization` header or
// metadata any client sends). The input names two keys, one as
// `proxy.api_key` (tenant "default") and one stored in a keys file as
// `sha256:<hex>` (tenant "t2"), and the header value; the value must
// authenticate exactly as the header's rule says: "Bearer " in any case,
// then spaces, then a configured key byte for byte, giving that key's
// tenant; anything else is UNAUTHENTICATED ("missing" only for an empty
// value). Two equal keys must be refused when the keys are loaded.
#include <openssl/sha.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "fuzz_util.h"
#include "proxy/tenants.h"

namespace {

std::string Take(const uint8_t*& p, const uint8_t* end) {
  if (p == end) return "";
  const size_t want = *p % 24;
  ++p;
  const size_t n = std::min(want, static_cast<size_t>(end - p));
  std::string s(reinterpret_cast<const char*>(p), n);
  p += n;
  return s;
}

std::string Sha256Hex(const std::string& s) {
  unsigned char d[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(s.data()), s.size(), d);
  static const char* kHex = "0123456789abcdef";
  std::string out;
  for (unsigned char c : d) {
    out.push_back(kHex[c >> 4]);
    out.push_back(kHex[c & 15]);
  }
  return out;
}

// The header's rule: which of the keys `value` presents (0: none).
int Presents(std::string_view value, const std::string& k1, const std::string& k2) {
  if (value.size() < 7) return 0;
  std::string scheme(value.substr(0, 7));
  for (char& c : scheme) {
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  }
  if (scheme != "bearer ") return 0;
  std::string_view key = value.substr(7);
  key.remove_prefix(std::min(key.find_first_not_of(' '), key.size()));
  if (key.empty()) return 0;
  if (key == k1) return 1;
  if (key == k2) return 2;
  return 0;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  tandem::fuzz::QuietLogs();
  const uint8_t* p = data;
  const uint8_t* end = data + size;
  const std::string k1 = Take(p, end);  // "" = no proxy.api_key
  const std::string k2 = Take(p, end);
  const std::string_view value(reinterpret_cast<const char*>(p), static_cast<size_t>(end - p));
  const std::string file = "- key: \"sha256:" + Sha256Hex(k2) + "\"\n  tenant: t2\n";
  auto tenants = tandem::proxy::Tenants::Parse(k1, file, "keys.yaml");
  if (!tenants.ok()) {
    // Only the same key twice is refused.
    if (k1.empty() || k1 != k2 ||
        tenants.status().message().find("the same key appears twice") == std::string::npos) {
      __builtin_trap();
    }
    return 0;
  }
  if ((!k1.empty() && k1 == k2) || !(*tenants)->required()) __builtin_trap();
  auto who = (*tenants)->Authenticate(value);
  const int want = Presents(value, k1, k2);
  if (want == 0) {
    if (who.ok() || who.status().code() != tandem::StatusCode::kUnauthenticated) __builtin_trap();
    const bool missing = who.status().message().starts_with("missing API key");
    if (missing != value.empty()) __builtin_trap();
    return 0;
  }
  if (!who.ok() || (*who)->name != (want == 1 ? "default" : "t2")) __builtin_trap();
  return 0;
}
