// The `prompt-floor` row of `tandem bench proxy` (issue 23): what one bare
// gRPC unary call carrying a prompt's token ids costs, measured in the same
// run as the `prompt` workload, so the proxy's CPU per admitted prompt has
// a physical limit beside it (docs/bench-serve.md).
//
// A child process serves tandem.v1.Prefiller/Prefill and answers every call
// at once (the request is parsed, nothing else); the bench process calls it
// with the proxy's own client code path (the callback stub, a PrefillRequest
// of N ids serialized per call), C calls in flight, once over plaintext
// (the public plane's kind of channel) and once over mutual TLS (the
// internal plane's, certificates of a throwaway CA), at the `prompt`
// workload's measured rate when it ran (else back to back). Reported per
// call: the server's CPU (the child's getrusage) and the client's (this
// process's). The proxy per prompt is a server of one such call (the client's
// Generate) and a client of two (Decode, Prefill), so
//   floor per prompt ~= server(plaintext) + 2 x client(mTLS).
//
// A third kind, `framed-mtls`, makes the same calls over the framed TCP
// transport of proxy.prefill_transport tcp (issue 23) with the proxy's
// PrefillTcpClient, the prompt sent as the proxy forwards it (the client's
// packed varints, in parts); its estimate line is plaintext server + 2 x
// framed client (both worker calls framed, as by default).
//
// The child is forked before this process starts any gRPC machinery
// (StartPromptFloor is called first), so it inherits no gRPC threads.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <memory>
#include <string>

#include "common/status.h"

namespace tandem::cli {

class PromptFloor {
 public:
  // Forks the server child; it listens on 127.0.0.1 only and exits when
  // this object goes (or this process dies).
  static Result<std::unique_ptr<PromptFloor>> Start();
  ~PromptFloor();
  PromptFloor(const PromptFloor&) = delete;
  PromptFloor& operator=(const PromptFloor&) = delete;

  // `requests` calls of `ids` token ids over each kind of channel back to
  // back with `concurrency` in flight, then, when `rate_per_s` > 0 (the
  // `prompt` workload's measured rate), min(`requests`, 64) calls paced at
  // it: one leaving every 1/rate s, as lone prompts arrive. Prints one line per kind and returns the JSON
  // rows.
  Result<nlohmann::json> Run(uint32_t requests, uint32_t ids, uint32_t concurrency,
                             double rate_per_s);

 private:
  PromptFloor() = default;
  // The child's CPU seconds (its getrusage: every thread, microseconds).
  double ServerCpuSeconds();
  int pid_ = -1;
  int control_fd_ = -1;  // 'c': report CPU; closing it tells the child to exit
  int reply_fd_ = -1;    // the child's answers
  std::string plain_address_, tls_address_, dir_, framed_address_;
};

}  // namespace tandem::cli
