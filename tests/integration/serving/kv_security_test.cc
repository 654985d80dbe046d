// The KV plane's capability check with real processes (docs/security.md,
// "KV plane"): a real `tandem decode` worker, this test playing the proxy
// over gRPC, and a second UCX agent in this process playing an intruder that
// knows the decoder's descriptor, the request id and even the reservation id,
// but not the reservation's capability. Its notices travel through real UCX
// and must be refused and counted, never acted on.
#include <sys/wait.h>
#include <xxhash.h>

#include <cstring>
#include <future>

#include "kvtransfer/descriptor.h"
#include "kvtransfer/kv_cipher.h"
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
  // Waits on the transfer's completion callback (bounded), not on polling.
  auto done = std::make_shared<std::promise<kv::XferStatus>>();
  auto result = done->get_future();
  EXPECT_TRUE(t.Post(*x, [done](kv::XferId, kv::XferStatus st, const Status&) {
                 done->set_value(st);
               }).ok());
  const kv::XferStatus st = result.wait_for(10s) == std::future_status::ready
                                ? result.get()
                                : t.Poll(*x);
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
  // A large one (as big as transport.encrypt's tags of a long prompt get)
  // still arrives whole through UCX, and is just as unreadable.
  EXPECT_EQ(SendNotice(**intruder, *peer, std::string(60000, '\xff')), kv::XferStatus::kSuccess);

  EXPECT_EQ(WaitForLabeled(metrics, "tandem_kv_notice_refused_total", "reason=\"capability\"", 3),
            3.0);
  EXPECT_EQ(WaitForLabeled(metrics, "tandem_kv_notice_refused_total", "reason=\"unreadable\"", 2),
            2.0);
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

// transport.encrypt with real processes and real UCX: a real `tandem
// decode` worker with encryption on; this test plays the proxy and the
// prefiller (it gets the reservation's key over gRPC, as a prefiller does)
// and pushes sealed KV through its own UCX agent. A network that flips a
// bit of the ciphertext, or of a tag, makes the decoder refuse the KV
// (DATA_LOSS, counted reason="decrypt") and free everything; untouched
// sealed KV decodes (and its transport.checksum sums, over the plaintext,
// verify after decryption).
enum class Tamper { kNone, kCiphertext, kTag };

struct SealedPush {
  Outcome out;
  uint32_t pushed_blocks = 0;
};

SealedPush PushSealed(pb::Decoder::Stub& stub, const std::string& id,
                      const std::vector<uint32_t>& prompt, Tamper tamper) {
  SealedPush r;
  pb::DecodeRequest dreq;
  dreq.set_request_id(id);
  dreq.mutable_prompt_token_ids()->Add(prompt.begin(), prompt.end());
  *dreq.mutable_params() = Greedy(4, true);
  DecodeCall call(stub, dreq);
  EXPECT_TRUE(call.ReadRegistered());
  pb::ReserveRequest rreq;
  rreq.set_request_id(id);
  rreq.set_prefiller("prefill-0");
  rreq.mutable_prompt_token_ids()->Add(prompt.begin(), prompt.end());
  pb::ReserveResponse rresp;
  grpc::ClientContext rctx;
  EXPECT_TRUE(stub.Reserve(&rctx, rreq, &rresp).ok());
  EXPECT_TRUE(rresp.has_target()) << rresp.error().message();
  const pb::KvTarget& t = rresp.target();
  EXPECT_EQ(t.kv_key().size(), kv::kKvKeyBytes);  // encryption on: every reservation has a key
  auto desc = kv::ParseDescriptor(t.transport_descriptor());
  EXPECT_TRUE(desc.ok()) << desc.status().ToString();
  if (!desc.ok() || t.kv_key().size() != kv::kKvKeyBytes) return r;

  // The prefiller's side: plaintext blocks sealed in place under the key.
  const uint32_t n = static_cast<uint32_t>(t.slots_size());
  const uint32_t cached = t.cached_blocks();
  r.pushed_blocks = n - cached;
  kv::TransportOptions o;
  o.backend = "ucx";
  o.agent_name = "prefill-0";
  o.block_bytes = desc->block_bytes;
  o.num_blocks = n;
  auto pre = kv::CreateTransport(o);
  EXPECT_TRUE(pre.ok()) << pre.status().ToString();
  if (!pre.ok()) return r;
  kv::Transport& tr = **pre;
  auto cipher = kv::KvCipher::Create(t.kv_key(), t.reservation_id());
  EXPECT_TRUE(cipher.ok());
  std::string tags(r.pushed_blocks * kv::kKvTagBytes, '\0');
  std::vector<uint64_t> sums;  // transport.checksum (on): XXH3-64 of the plaintext
  std::vector<kv::BlockPair> pairs;
  for (uint32_t b = cached; b < n; ++b) {
    float* f = reinterpret_cast<float*>(tr.block(b));
    for (uint64_t i = 0; i < desc->block_bytes / sizeof(float); ++i) f[i] = 0.01f * float((i + b) % 97);
    sums.push_back(XXH3_64bits(tr.block(b), desc->block_bytes));
    EXPECT_TRUE(cipher->Seal(b, tr.block(b), tr.block(b), desc->block_bytes,
                             reinterpret_cast<std::byte*>(tags.data()) + (b - cached) * kv::kKvTagBytes)
                    .ok());
    pairs.push_back({b, static_cast<uint32_t>(t.slots(static_cast<int>(b)))});
  }
  // On the wire, between the two processes:
  if (tamper == Tamper::kCiphertext) tr.block(n - 1)[desc->block_bytes / 2] ^= std::byte{0x01};
  if (tamper == Tamper::kTag) tags[0] = static_cast<char>(tags[0] ^ 0x80);
  pb::KvNotice notice;
  notice.set_request_id(id);
  notice.set_reservation_id(t.reservation_id());
  notice.set_generation(t.generation());
  notice.set_first_token_id(prompt[0]);
  notice.set_capability(t.capability());
  notice.set_kv_tags(tags);
  for (uint64_t sum : sums) notice.add_block_checksums(sum);
  auto peer = tr.ImportPeer(t.transport_descriptor());
  EXPECT_TRUE(peer.ok()) << peer.status().ToString();
  if (!peer.ok()) return r;
  EXPECT_EQ(SendNotice(tr, *peer, notice.SerializeAsString(), pairs), kv::XferStatus::kSuccess);
  call.ReadInto(r.out);
  r.out.decode_status = call.Finish();
  EXPECT_TRUE(tr.ReleasePeer(*peer).ok());
  return r;
}

TEST(KvSecurityTest, TamperedEncryptedKvIsRefusedCountedAndFreedThroughRealUcx) {
  const fs::path dir = fs::temp_directory_path() / ("tandem-kvenc-" + std::to_string(getpid()));
  const std::string fleet = WriteFleetFile(dir, "  encrypt: true\n");
  auto cfg = model::LoadModelConfig(ModelDir());
  ASSERT_TRUE(cfg.ok()) << cfg.status().ToString();
  cli::Supervisor sup;
  auto d = StartWorker(sup, fleet, "decode", "decode-0");
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  const std::string metrics = (*d)->metrics;
  auto stub = pb::Decoder::NewStub(InternalChannel(fleet, (*d)->grpc));
  EXPECT_EQ(LabeledValue(Scrape(metrics), "tandem_kv_notice_refused_total", "reason=\"decrypt\""),
            0.0);
  const uint32_t vocab = std::min<uint32_t>(cfg->vocab_size, 4096);

  int refused = 0;
  for (Tamper tamper : {Tamper::kCiphertext, Tamper::kTag}) {
    SCOPED_TRACE(tamper == Tamper::kTag ? "tag" : "ciphertext");
    const std::string id = "kvenc-bad-" + std::to_string(refused);
    SealedPush p = PushSealed(*stub, id, Prompt(40, 11 + refused, vocab), tamper);
    ++refused;
    ASSERT_EQ(p.pushed_blocks, 3u);
    // Fail closed: no token, an error naming the check.
    EXPECT_TRUE(p.out.tokens.empty());
    EXPECT_FALSE(p.out.finished.has_value());
    ASSERT_TRUE(p.out.error.has_value()) << p.out.decode_status.error_message();
    EXPECT_EQ(p.out.error->code(), static_cast<int>(StatusCode::kDataLoss)) << p.out.error->message();
    EXPECT_NE(p.out.error->message().find("failed authentication (transport.encrypt)"),
              std::string::npos) << p.out.error->message();
    EXPECT_EQ(WaitForLabeled(metrics, "tandem_kv_notice_refused_total", "reason=\"decrypt\"",
                             refused), double(refused));
    // Nothing leaked: no reservation, no block held, nothing running.
    EXPECT_EQ(WaitForIdle(metrics), "");
  }
  // Untouched sealed KV is opened and decoded.
  SealedPush good = PushSealed(*stub, "kvenc-good", Prompt(40, 21, vocab), Tamper::kNone);
  ASSERT_TRUE(good.out.finished.has_value()) << (good.out.error ? good.out.error->message() : "no end");
  EXPECT_EQ(good.out.tokens.size(), 4u);
  const std::string after = Scrape(metrics);
  EXPECT_EQ(LabeledValue(after, "tandem_kv_notice_refused_total", "reason=\"decrypt\""), 2.0);
  EXPECT_EQ(WaitForIdle(metrics), "");

  EXPECT_EQ(sup.StopAll(10s), 0);
  for (const auto& c : sup.children()) {
    EXPECT_TRUE(WIFEXITED(c.exit_status) && WEXITSTATUS(c.exit_status) == 0) << cli::DescribeExit(c);
  }
  std::error_code ec;
  fs::remove_all(dir, ec);
}

}  // namespace
}  // namespace tandem::serving_test
