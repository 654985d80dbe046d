// fuzz_make_seeds OUT_DIR: writes the seed inputs of fuzz_kv_notice (binary
// formats with checksums, so they are made by the code that defines them):
// transport descriptors, framed notices and KvNotice payloads of the kinds a
// decoder receives. The other targets' seeds are the repository's fixtures
// (tools/fuzz.sh seeds).
#include <cstdio>
#include <fstream>
#include <string>

#include "kvtransfer/descriptor.h"
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
  if (argc != 2) {
    std::fprintf(stderr, "usage: fuzz_make_seeds OUT_DIR\n");
    return 2;
  }
  const std::string dir = argv[1];
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
  Write(dir, "descriptor_ucx", kv::SerializeDescriptor(d));
  d.backend = "loopback";
  d.address.clear();
  d.rkey.clear();
  Write(dir, "descriptor_loopback", kv::SerializeDescriptor(d));

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
  return g_failed ? 1 : 0;
}
