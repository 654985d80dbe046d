// The KV plane's capability check with real processes (docs/security.md,
// "KV plane"): a real `tandem decode` worker, this test playing the proxy
// over gRPC, and a second UCX agent in this process playing an intruder that
// knows the decoder's descriptor, the request id and even the reservation id,
// but not the reservation's capability. Its notices travel through real UCX
// and must be refused and counted, never acted on.
#include <sys/wait.h>
#include <xxhash.h>

#include <cstring>

#include "kvtransfer/descriptor.h"
#include "kvtransfer/kv_secret.h"
#include "kvtransfer/transport.h"
#include "serving_harness.h"

namespace tandem::serving_test {
namespace {

namespace kv = tandem::kvtransfer;

// The sample of `name` whose labels contain `label` (e.g. reason="capability").
std::optional<double> LabeledValue(const std::string& text, const std::string& name,
                                   const std::string& label) {
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(name + "{", 0) != 0 || line.find(label) == std::string::npos) continue;
    return std::stod(line.substr(line.rfind(' ') + 1));
  }
  return std::nullopt;
}

// Polls the worker's /metrics until the labeled sample reaches `want`.
double WaitForLabeled(const std::string& address, const std::string& name,
                      const std::string& label, double want) {
  const auto give_up = std::chrono::steady_clock::now() + 10s;
  double v = -1;
  while (std::chrono::steady_clock::now() < give_up) {
    v = LabeledValue(Scrape(address), name, label).value_or(-1);
    if (v >= want) return v;
    std::this_thread::sleep_for(50ms);
  }
  return v;
}

// Sends `payload` as a notice-only write (after `blocks`, if any) and waits
// for it to be delivered.
kv::XferStatus SendNotice(kv::Transport& t, kv::PeerId peer, const std::string& payload,
                          const std::vector<kv::BlockPair>& blocks = {}) {
  auto x = blocks.empty() ? t.PrepareWrite(peer, {}, payload) : t.PrepareBlockWrite(peer, blocks, payload);
  EXPECT_TRUE(x.ok()) << x.status().ToString();
  if (!x.ok()) return kv::XferStatus::kErrInvalidArgument;
  EXPECT_TRUE(t.Post(*x).ok());
  const auto give_up = std::chrono::steady_clock::now() + 10s;
  kv::XferStatus st = t.Poll(*x);
  while (!kv::IsTerminal(st) && std::chrono::steady_clock::now() < give_up) {
    std::this_thread::sleep_for(5ms);
    st = t.Poll(*x);
  }
  EXPECT_TRUE(t.Release(*x).ok());
  return st;
}

TEST(KvSecurityTest, NoticeWithAWrongCapabilityIsRefusedAndCountedThroughRealUcx) {
  const fs::path dir = fs::temp_directory_path() / ("tandem-kvsec-" + std::to_string(getpid()));
  const std::string fleet = WriteFleetFile(dir);
  auto cfg = model::LoadModelConfig(ModelDir());
  ASSERT_TRUE(cfg.ok()) << cfg.status().ToString();
  cli::Supervisor sup;
  auto d = StartWorker(sup, fleet, "decode", "decode-0");
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  const std::string metrics = (*d)->metrics;
  auto stub = pb::Decoder::NewStub(InternalChannel(fleet, (*d)->grpc));

  // Every refusal series exists at zero from start-up.
  const std::string scrape = Scrape(metrics);
  EXPECT_EQ(LabeledValue(scrape, "tandem_kv_notice_refused_total", "reason=\"capability\""), 0.0);
  EXPECT_EQ(LabeledValue(scrape, "tandem_kv_notice_refused_total", "reason=\"unreadable\""), 0.0);

  // The proxy's part: open the Decode stream; a prefiller's part: Reserve.
  const auto prompt = Prompt(40, 7, std::min<uint32_t>(cfg->vocab_size, 4096));
  pb::DecodeRequest dreq;
  dreq.set_request_id("kvsec-1");
  dreq.mutable_prompt_token_ids()->Add(prompt.begin(), prompt.end());
  *dreq.mutable_params() = Greedy(4, true);
  DecodeCall call(*stub, dreq);
  ASSERT_TRUE(call.ReadRegistered());
  pb::ReserveRequest rreq;
  rreq.set_request_id("kvsec-1");
  rreq.set_prefiller("prefill-0");
  rreq.mutable_prompt_token_ids()->Add(prompt.begin(), prompt.end());
  pb::ReserveResponse rresp;
  grpc::ClientContext rctx;
  ASSERT_TRUE(stub->Reserve(&rctx, rreq, &rresp).ok());
  ASSERT_TRUE(rresp.has_target()) << rresp.error().message();
  const pb::KvTarget& target = rresp.target();
  ASSERT_EQ(target.capability().size(), kv::kCapabilityBytes);

  // The intruder: its own UCX agent, connected to the decoder's pool.
  auto desc = kv::ParseDescriptor(target.transport_descriptor());
  ASSERT_TRUE(desc.ok()) << desc.status().ToString();
  kv::TransportOptions o;
  o.backend = "ucx";
  o.agent_name = "intruder";
  o.block_bytes = desc->block_bytes;
  o.num_blocks = 2;
  auto intruder = kv::CreateTransport(o);
  ASSERT_TRUE(intruder.ok()) << intruder.status().ToString();
  auto peer = (*intruder)->ImportPeer(target.transport_descriptor());
  ASSERT_TRUE(peer.ok()) << peer.status().ToString();

  pb::KvNotice forged;
  forged.set_request_id("kvsec-1");
  forged.set_reservation_id(target.reservation_id());
  forged.set_generation(target.generation());
  forged.set_first_token_id(prompt[0]);
  auto guess = kv::NewCapability();
  ASSERT_TRUE(guess.ok());
  forged.set_capability(*guess);
  EXPECT_EQ(SendNotice(**intruder, *peer, forged.SerializeAsString()), kv::XferStatus::kSuccess);
  pb::KvNotice no_capability = forged;  // what a pre-capability prefiller sends
  no_capability.clear_capability();
  EXPECT_EQ(SendNotice(**intruder, *peer, no_capability.SerializeAsString()),
            kv::XferStatus::kSuccess);
  pb::KvNotice forged_error = forged;  // would free the reservation if believed
  forged_error.mutable_error()->set_code(static_cast<int>(StatusCode::kCancelled));
  forged_error.mutable_error()->set_message("forged");
  EXPECT_EQ(SendNotice(**intruder, *peer, forged_error.SerializeAsString()),
            kv::XferStatus::kSuccess);
  EXPECT_EQ(SendNotice(**intruder, *peer, std::string("\xff\xff\xff garbage", 12)),
            kv::XferStatus::kSuccess);

  EXPECT_EQ(WaitForLabeled(metrics, "tandem_kv_notice_refused_total", "reason=\"capability\"", 3),
            3.0);
  EXPECT_EQ(WaitForLabeled(metrics, "tandem_kv_notice_refused_total", "reason=\"unreadable\"", 1),
            1.0);
  // Nothing was acted on: the reservation is still held, no stale count.
  const std::string after = Scrape(metrics);
  EXPECT_EQ(MetricValue(after, "tandem_kv_reservations"), 1.0);
  EXPECT_EQ(MetricValue(after, "tandem_kv_stale_notices_total"), 0.0);

  // The genuine notice (same fields plus the capability) starts decoding.
  // Like a prefiller, its writer pushes the slots (zeros here) before it and
  // carries their XXH3-64 (transport.checksum, on by default).
  pb::KvNotice genuine = forged;
  genuine.set_capability(target.capability());
  std::memset((*intruder)->block(0), 0, (*intruder)->block_bytes());
  std::vector<kv::BlockPair> zeros;
  for (int i = static_cast<int>(target.cached_blocks()); i < target.slots_size(); ++i) {
    zeros.push_back({0, target.slots(i)});
    genuine.add_block_checksums(XXH3_64bits((*intruder)->block(0), (*intruder)->block_bytes()));
  }
  EXPECT_EQ(SendNotice(**intruder, *peer, genuine.SerializeAsString(), zeros), kv::XferStatus::kSuccess);
  Outcome out;
  call.ReadInto(out);
  EXPECT_TRUE(call.Finish().ok());
  ASSERT_TRUE(out.finished.has_value()) << (out.error ? out.error->message() : "no end");
  EXPECT_EQ(out.tokens.size(), 4u);
  EXPECT_EQ(out.tokens[0], prompt[0]);  // the notice's first token
  EXPECT_EQ(WaitForIdle(metrics), "");

  EXPECT_TRUE((*intruder)->ReleasePeer(*peer).ok());
  intruder->reset();
  EXPECT_EQ(sup.StopAll(10s), 0);
  for (const auto& c : sup.children()) {
    EXPECT_TRUE(WIFEXITED(c.exit_status) && WEXITSTATUS(c.exit_status) == 0) << cli::DescribeExit(c);
  }
  std::error_code ec;
  fs::remove_all(dir, ec);
}

}  // namespace
}  // namespace tandem::serving_test
