// `tandem bench kvtransfer --encrypt` (transport.encrypt, docs/security.md):
// the same requests once more with every block sealed (AES-256-GCM) into
// staging blocks before the put and opened in place by the target after
// its notice — the serving path's order — next to the plaintext run and
// memcpy of the same bytes as the physical reference.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "common/status.h"
#include "kvtransfer/transport.h"

namespace tandem::cli::kvbench {

// Target side: opens an encrypted request's blocks in place when its notice
// arrives (on the transport's progress thread, as a decoder does).
class EncryptedReceiver {
 public:
  explicit EncryptedReceiver(kvtransfer::Transport& t) : t_(t) {}
  // Handles a notice made by RunEncrypted; false for any other payload.
  bool OnNotice(const std::string& payload);
  // Waits (bounded) until request `index` was opened; "INDEX OPEN_SECONDS FAILURES".
  std::string Wait(uint64_t index, double timeout_s);

 private:
  kvtransfer::Transport& t_;
  std::mutex mu_;
  int64_t last_opened_ = -1;   // guarded by mu_
  double open_seconds_ = 0;    // guarded by mu_ (total)
  uint64_t failures_ = 0;      // guarded by mu_
};

struct EncryptedRun {
  uint32_t requests = 0;   // measured (after warm-up)
  uint64_t bytes = 0;      // payload bytes of the measured requests
  double seal_s = 0;       // sender: sealing into staging
  double transfer_s = 0;   // post -> data remotely complete and notice sent
  double open_s = 0;       // receiver: checking tags and decrypting in place
  double total_s = 0;      // wall time of the measured requests, end to end
  uint64_t failures = 0;   // blocks whose tag did not verify (must be 0)
};

// Asks the target to wait for request `index`; returns its Wait() answer.
using AskTarget = std::function<Result<std::string>(uint64_t index)>;

// Requests one at a time: seal `pairs`' local blocks (a fresh key per
// request, carried in the notice — a benchmark shortcut; tandem sends keys
// over the control plane), put them, and wait until the target opened them.
Result<EncryptedRun> RunEncrypted(kvtransfer::Transport& t, kvtransfer::PeerId peer,
                                  const std::vector<kvtransfer::BlockPair>& pairs, uint32_t warmup,
                                  uint32_t requests, const AskTarget& ask);

// memcpy bandwidth (bytes/s) over two buffers of `bytes`, best of `reps`.
double MemcpyBandwidth(uint64_t bytes, int reps);

}  // namespace tandem::cli::kvbench
