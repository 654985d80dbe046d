// WorkerClient over gRPC (worker.proto), with one channel per worker
// address, reused by every call.
#pragma once

#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "common/frame_conn.h"
#include "common/tls.h"
#include "proxy/reactor_drain.h"
#include "proxy/worker_client.h"

namespace tandem::model {
struct TokenBytesTable;
}  // namespace tandem::model

namespace grpc {
class Channel;
}

namespace tandem::proxy {

class DecodeMux;
class DecodeMuxTcpClient;
class PrefillTcpClient;

class GrpcWorkerClient final : public WorkerClient {
 public:
  // Every channel uses `credentials` (the internal plane's: mutual TLS by default).
  // `decode_stream` (proxy.decode_stream, issue 23): Decode goes over one
  // multiplexed decode stream per decoder that advertises it
  // (SetDecodeStream); otherwise one Decode RPC per request. `decode_tcp`
  // (proxy.decode_transport tcp): that stream is the decoder's framed TCP
  // one where it advertises it (SetDecodeMuxAddress), with the same mutual
  // TLS identity; otherwise the gRPC DecodeStream. `tcp_deliver_on_grpc_thread`
  // (proxy/decode_mux_tcp_client.h): the TCP stream's batches are handed to
  // the requests on a gRPC thread (the public gRPC C++ server's writes then
  // leave in one flush) rather than on its reader thread (the native front
  // end flushes at the end of the reader's batch).
  explicit GrpcWorkerClient(RpcCredentials credentials, bool decode_stream = true,
                            bool decode_tcp = true, bool tcp_deliver_on_grpc_thread = true);
  ~GrpcWorkerClient() override;

  // Whether the worker at `address` serves Decoder.DecodeStream
  // (WorkerInfo.decode_stream, from its registration).
  void SetDecodeStream(const std::string& address, bool served);
  // Where the worker at `address` serves the decode stream over framed TCP
  // (WorkerInfo.decode_mux_address; empty: it does not).
  void SetDecodeMuxAddress(const std::string& address, const std::string& mux_address);
  // proxy.prefill_transport (issue 23, docs/serving-workers.md "Prefill
  // transport"): with `tcp`, Prefill goes over the prefiller's framed TCP
  // listener where it advertises one (SetPrefillFrameAddress; one
  // connection per prefiller, the internal plane's mutual TLS identity),
  // else the gRPC Prefiller.Prefill. Set once, before the first call.
  void SetPrefillTransport(bool tcp);
  // The proxy tokenizer's byte table (may be null): every decode stream
  // prefetches the entries and bytes of a batch's tokens with it, before
  // its requests detokenize them (issue 23, tok-chain). Set once, before
  // the first call.
  void SetTokenTable(const model::TokenBytesTable* table);
  // Where the worker at `address` serves Prefill over framed TCP
  // (WorkerInfo.prefill_frame_address; empty: it does not).
  void SetPrefillFrameAddress(const std::string& address, const std::string& frame_address);
  // Whether the worker at `address` reads the prompt as fixed32
  // (WorkerInfo.reads_fixed32_prompt; docs/serving-workers.md, "Prompt
  // encoding"): Decode and Prefill to it then send
  // prompt_token_ids_fixed32 instead of the packed varints.
  void SetPromptFixed32(const std::string& address, bool reads);

  std::shared_ptr<Call> Decode(const std::string& address, DecodeArgs args,
                               DecodeEvents events) override;
  std::shared_ptr<Call> Prefill(const std::string& address, PrefillArgs args,
                                std::function<void(Result<PrefillResult>)> done) override;

  // The shared channel to `address` (created on first use).
  std::shared_ptr<grpc::Channel> Channel(const std::string& address);

  // Ends every Decode and Prefill call in flight to `address` as if the
  // worker had died (UNAVAILABLE with `why`): the proxy's liveness check
  // decided it is gone, e.g. a paused process whose connections stay open.
  // Calls started to `address` from then on end the same way, at once,
  // until Reachable(address): a request routed there just before (its
  // Prefill starts only once the decoder registered it) would otherwise
  // wait for a stopped worker that may never answer, up to its deadline.
  // Returns how many calls were ended. Any thread; callbacks run later.
  size_t AbandonCalls(const std::string& address, const std::string& why);
  // The worker at `address` answers again (a probe's snapshot, or it
  // registered): calls to it are made normally again.
  void Reachable(const std::string& address);

  // A call that AbandonCalls can end.
  class Tracked {
   public:
    virtual ~Tracked() = default;
    void Abandon(const std::string& why);
    // Non-empty once abandoned.
    std::string abandoned() const;

   protected:
    virtual void CancelRpc() = 0;

   private:
    mutable std::mutex mu_;
    std::string why_;  // guarded by mu_
  };

 private:
  // Registers `call` for AbandonCalls; a call to an address given up
  // already is abandoned at once.
  void Track(const std::string& address, const std::shared_ptr<Tracked>& call);
  std::shared_ptr<grpc::Channel> ChannelLocked(const std::string& address);
  bool PromptFixed32(const std::string& address);
  // The live decode stream to `address` (a new one when `stale` is the
  // current one or there is none); null when it does not serve one.
  std::shared_ptr<DecodeMux> Mux(const std::string& address, const DecodeMux* stale = nullptr);
  // The live framed Prefill connection to `address` (a new one when
  // `stale` is the current one or there is none); null when it has none.
  std::shared_ptr<PrefillTcpClient> PrefillClient(const std::string& address,
                                                  const PrefillTcpClient* stale = nullptr);

  const RpcCredentials credentials_;
  const bool decode_stream_;
  bool decode_tcp_;
  const bool tcp_deliver_on_grpc_thread_;
  std::shared_ptr<FrameTls> frame_tls_;  // the framed connections' TLS; null: plaintext
  bool frame_tls_ready_ = false;  // frame_tls_ was made (null can mean plaintext)
  std::mutex mu_;
  const model::TokenBytesTable* token_table_ = nullptr;  // guarded by mu_
  bool prefill_tcp_ = false;  // guarded by mu_: proxy.prefill_transport tcp
  std::unordered_map<std::string, std::string> prefill_tcp_addresses_;  // guarded by mu_
  std::unordered_map<std::string, std::shared_ptr<PrefillTcpClient>> prefill_clients_;  // guarded by mu_
  std::vector<std::weak_ptr<PrefillTcpClient>> prefill_tcp_clients_;  // guarded by mu_: stopped with the client
  std::unordered_set<std::string> mux_addresses_;  // guarded by mu_: serve DecodeStream
  // guarded by mu_: read the fixed32 prompt (WorkerInfo.reads_fixed32_prompt)
  std::unordered_set<std::string> fixed32_prompt_addresses_;
  std::unordered_map<std::string, std::string> tcp_addresses_;  // guarded by mu_: gRPC -> framed TCP
  std::unordered_map<std::string, std::shared_ptr<DecodeMux>> muxes_;  // guarded by mu_
  // Every TCP stream opened (stopped and joined with the client).
  std::vector<std::weak_ptr<DecodeMuxTcpClient>> tcp_muxes_;  // guarded by mu_
  std::unordered_map<std::string, std::shared_ptr<grpc::Channel>> channels_;  // guarded by mu_
  // The Decode and Prefill RPCs' reactors (not the gRPC decode streams,
  // which live until their decoder ends them): the destructor waits for
  // them, at most kReactorDrainBound, before the channels go.
  ReactorDrain drain_;
  static constexpr std::chrono::milliseconds kReactorDrainBound{2000};
  // Calls in flight per worker address (expired entries pruned as we go).
  std::unordered_map<std::string, std::vector<std::weak_ptr<Tracked>>> calls_;  // guarded by mu_
  // Addresses given up by AbandonCalls and not Reachable since -> why.
  std::unordered_map<std::string, std::string> abandoned_;  // guarded by mu_
};

}  // namespace tandem::proxy
