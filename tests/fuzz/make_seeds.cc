// fuzz_make_seeds KV_NOTICE_DIR [DESCRIPTOR_DIR]: writes the seed inputs of
// fuzz_kv_notice and fuzz_descriptor (binary formats with checksums, so
// they are made by the code that defines them): transport descriptors,
// framed notices and KvNotice payloads of the kinds a decoder receives.
// The version-1 descriptor seeds (v1_*) are committed as session 13's code
// wrote them and not regenerated. The other targets' seeds are the
// repository's fixtures (tools/fuzz.sh seeds).
#include <cstdio>
#include <fstream>
#include <string>

#include "kvtransfer/descriptor.h"
#include "kvtransfer/staging/staging_notice.h"
#include "kvtransfer/transport_base.h"
#include "tandem/v1/worker.pb.h"

namespace {

bool g_failed = false;

void Write(const std::string& dir, const std::string& name, const std::string& bytes) {
  std::ofstream out(dir + "/" + name, std::ios::binary);
  out << bytes;
  if (!out) {
    std::fprintf(stderr, "fuzz_make_seeds: cannot write %s/%s\n", dir.c_str(), name.c_str());
    g_failed = true;
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2 && argc != 3) {
    std::fprintf(stderr, "usage: fuzz_make_seeds KV_NOTICE_DIR [DESCRIPTOR_DIR]\n");
    return 2;
  }
  const std::string dir = argv[1];
  const std::string desc_dir = argc == 3 ? argv[2] : argv[1];
  namespace kv = tandem::kvtransfer;
  kv::PeerDescriptor d;
  d.backend = "ucx";
  d.agent_name = "decode-0";
  d.generation = 1764590000123456789ull;
  d.block_bytes = 65536;
  d.num_blocks = 512;
  d.remote_base = 0x7f0000000000ull;
  d.address = std::string(64, '\x11');
  d.rkey = std::string(32, '\x22');
  d.process = {4711, 123456789, 4026531836, "d511850e-c1f7-44f5-ba3b-85b6c6eee4bf"};
  Write(desc_dir, "descriptor_ucx", kv::SerializeDescriptor(d));
  kv::PeerDescriptor unknown = d;  // an exporter that could not read /proc
  unknown.process = {};
  Write(desc_dir, "descriptor_unknown_process", kv::SerializeDescriptor(unknown));
  d.backend = "loopback";
  d.address.clear();
  d.rkey.clear();
  Write(desc_dir, "descriptor_loopback", kv::SerializeDescriptor(d));

  tandem::v1::KvNotice ok;
  ok.set_request_id("req-1");
  ok.set_reservation_id(0x9e3779b97f4a7c15ull);
  ok.set_generation(d.generation);
  ok.set_first_token_id(42);
  ok.set_prefill_cached_prompt_tokens(32);
  ok.set_capability(std::string(16, '\x5a'));
  tandem::v1::KvNotice gave_up = ok;
  gave_up.mutable_error()->set_code(14);
  gave_up.mutable_error()->set_message("prefiller gave up");
  Write(dir, "notice_ok", ok.SerializeAsString());
  Write(dir, "notice_error", gave_up.SerializeAsString());
  Write(dir, "framed_ok", kv::detail::EncodeNotice(d.generation, 7, "prefill-0", ok.SerializeAsString()));
  Write(dir, "framed_error",
        kv::detail::EncodeNotice(d.generation, 7, "prefill-0", gave_up.SerializeAsString()));
  Write(dir, "hex", kv::ToHex(kv::SerializeDescriptor(d)));
  // transport.encrypt's tags and transport.checksum's sums, 3 pushed blocks.
  tandem::v1::KvNotice sealed = ok;
  sealed.set_kv_tags(std::string(3 * 16, '\x3c'));
  for (uint64_t i = 0; i < 3; ++i) sealed.add_block_checksums(0x0123456789abcdefull * (i + 1));
  Write(dir, "notice_sealed", sealed.SerializeAsString());
  // The staging path's notices (cuda workers): a manifest and a user notice.
  namespace stg = kv::staging;
  stg::StagingNotice m;
  m.kind = stg::StagingNotice::Kind::kManifest;
  m.count = 3;
  m.ranges = {{0, 65536}, {131072, 196608}};
  Write(dir, "staging_manifest", stg::EncodeStagingNotice(m));
  stg::StagingNotice u;
  u.kind = stg::StagingNotice::Kind::kUser;
  u.count = 4;
  u.payload = sealed.SerializeAsString();
  Write(dir, "staging_user", stg::EncodeStagingNotice(u));
  return g_failed ? 1 : 0;
}
