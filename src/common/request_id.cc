#include "common/request_id.h"

#include <pthread.h>
#include <string.h>
#include <sys/random.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <mutex>

#include "common/check.h"

namespace tandem {
namespace {

bool IsLowerHex(std::string_view s) {
  return std::all_of(s.begin(), s.end(),
                     [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

}  // namespace

namespace {

// Random bytes handed out 16 at a time from a per-thread pool that one
// getrandom(2) call fills (issue 23: a getrandom per request was a syscall
// on the admission path): the ids are the kernel CSPRNG's bytes as before,
// one syscall per 256 of them. The pool is wiped as it is used and at the
// thread's end; a forked child drops what it inherited (the parent hands
// the same bytes out), so no two processes give out the same id.
constexpr size_t kPoolBytes = 4096;

struct RandomPool {
  unsigned char bytes[kPoolBytes];
  size_t used = kPoolBytes;  // bytes[used, kPoolBytes) not handed out yet
  ~RandomPool() { explicit_bzero(bytes, sizeof bytes); }
};

thread_local std::unique_ptr<RandomPool> tls_pool;

void DropPoolAfterFork() {
  if (tls_pool) {
    explicit_bzero(tls_pool->bytes, sizeof tls_pool->bytes);
    tls_pool->used = kPoolBytes;
  }
}

void FillRandom(unsigned char* p, size_t bytes) {
  size_t got = 0;
  while (got < bytes) {
    const ssize_t n = getrandom(p + got, bytes - got, 0);
    if (n < 0 && errno == EINTR) continue;
    TANDEM_CHECK(n > 0);
    got += static_cast<size_t>(n);
  }
}

// 16 bytes never handed out before (in this process or its parent).
void Random16(unsigned char out[16]) {
  static std::once_flag fork_handler;
  std::call_once(fork_handler, [] { pthread_atfork(nullptr, nullptr, DropPoolAfterFork); });
  if (!tls_pool) tls_pool = std::make_unique<RandomPool>();
  RandomPool& pool = *tls_pool;
  if (pool.used + 16 > kPoolBytes) {
    FillRandom(pool.bytes, kPoolBytes);
    pool.used = 0;
  }
  std::memcpy(out, pool.bytes + pool.used, 16);
  explicit_bzero(pool.bytes + pool.used, 16);
  pool.used += 16;
}

}  // namespace

std::string RandomHex128() {
  unsigned char bytes[16];
  Random16(bytes);
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out(kFleetNonceChars, '0');
  for (size_t i = 0; i < sizeof bytes; ++i) {
    out[2 * i] = kHex[bytes[i] >> 4];
    out[2 * i + 1] = kHex[bytes[i] & 15];
  }
  explicit_bzero(bytes, sizeof bytes);
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
