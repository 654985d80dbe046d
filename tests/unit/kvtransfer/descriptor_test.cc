// The KV descriptor's version 2 (the exporting process's identity) and the
// /proc reads behind the handshake's liveness rule (docs/kvtransfer.md,
// "Descriptor format", "Connection handshake").
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <set>
#include <string>

#include "descriptor_v1.h"
#include "kv_test_util.h"
#include "kvtransfer/descriptor.h"
#include "kvtransfer/process_identity.h"
#include "kvtransfer/transport.h"

namespace tandem::kvtransfer {
namespace {

using testing::SerializeDescriptorV1;
using testing::WaitFor;
using namespace std::chrono_literals;

PeerDescriptor Sample() {
  PeerDescriptor d{"ucx", "prefill-0", 777, 4096, 64, 0x1000, std::string("\0addr", 5), "rk"};
  d.process = {4711, 123456, 4026531836, "d511850e-c1f7-44f5-ba3b-85b6c6eee4bf"};
  return d;
}

std::string ProcStatLine(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  std::getline(in, line);
  return line;
}

TEST(DescriptorV2, CarriesTheExportersIdentity) {
  const PeerDescriptor d = Sample();
  const std::string bytes = SerializeDescriptor(d);
  EXPECT_EQ(bytes.substr(4, 4), std::string("\x02\0\0\0", 4)) << "not written as version 2";
  auto back = ParseDescriptor(bytes);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->process, d.process);
  EXPECT_TRUE(back->process.known());
  EXPECT_EQ(back->agent_name, "prefill-0");
  EXPECT_EQ(back->rkey, "rk");
  EXPECT_EQ(SerializeDescriptor(*back), bytes);
  for (size_t i = 0; i < bytes.size(); ++i) {  // any flipped byte is caught
    std::string bad = bytes;
    bad[i] ^= 0x21;
    EXPECT_FALSE(ParseDescriptor(bad).ok()) << "flip at " << i;
  }
}

// A peer still on the old build (mid-upgrade) sends version 1: accepted,
// its identity unknown (the handshake then keeps its plain timeout).
TEST(DescriptorV2, ReadsVersion1WithAnUnknownIdentity) {
  const PeerDescriptor d = Sample();
  auto back = ParseDescriptor(SerializeDescriptorV1(d));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->agent_name, d.agent_name);
  EXPECT_EQ(back->generation, d.generation);
  EXPECT_EQ(back->block_bytes, d.block_bytes);
  EXPECT_EQ(back->num_blocks, d.num_blocks);
  EXPECT_EQ(back->remote_base, d.remote_base);
  EXPECT_EQ(back->address, d.address);
  EXPECT_EQ(back->rkey, d.rkey);
  EXPECT_EQ(back->process, ProcessIdentity{});
  EXPECT_FALSE(back->process.known());
  EXPECT_FALSE(back->process.SameHostAndNamespace(LocalProcessIdentity()));
}

// Every cut of a v2 descriptor is refused, naming the field it fell in.
TEST(DescriptorV2, EveryTruncationNamesItsField) {
  const std::string bytes = SerializeDescriptor(Sample());
  std::set<std::string> fields;
  for (size_t n = 0; n < bytes.size(); ++n) {
    auto r = ParseDescriptor(bytes.substr(0, n));
    ASSERT_FALSE(r.ok()) << "cut at " << n;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    const std::string m(r.status().message());
    if (n < 16) {
      EXPECT_NE(m.find("not a tandem descriptor"), std::string::npos) << n << ": " << m;
      continue;
    }
    const auto q = m.find("truncated in field '");
    ASSERT_NE(q, std::string::npos) << n << ": " << m;
    fields.insert(m.substr(q + 20, m.find('\'', q + 20) - q - 20));
  }
  // (A cut before byte 16 is "not a tandem descriptor"; "ucx" ends there.)
  EXPECT_EQ(fields, (std::set<std::string>{"agent", "generation", "block_bytes",
                                           "num_blocks", "remote_base", "address", "rkey", "pid",
                                           "start_time_ticks", "pid_namespace", "boot_id",
                                           "checksum"}));
  // The cut inside the identity says which part.
  const size_t boot_at = bytes.size() - 8 - 36;  // boot_id's bytes, before the checksum
  EXPECT_NE(ParseDescriptor(bytes.substr(0, boot_at + 3)).status().message().find("'boot_id'"),
            std::string::npos);
  auto trailing = ParseDescriptor(bytes + "x");
  EXPECT_NE(trailing.status().message().find("1 trailing bytes"), std::string::npos)
      << trailing.status().ToString();
}

TEST(DescriptorV2, LengthsPastTheLimitNameTheFieldAndTheLimit) {
  PeerDescriptor d = Sample();
  d.process.boot_id = std::string(65, 'b');
  auto r = ParseDescriptor(SerializeDescriptor(d));
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("field 'boot_id' is 65 bytes; at most 64"), std::string::npos)
      << r.status().ToString();
  d.process.boot_id = std::string(64, 'b');  // the limit itself is fine
  EXPECT_TRUE(ParseDescriptor(SerializeDescriptor(d)).ok());

  // A length word that claims 4 GiB for the address.
  std::string bytes = SerializeDescriptor(Sample());
  const size_t address_len_at = 4 + 4 + (4 + 3) + (4 + 9) + 8 + 8 + 4 + 8;
  ASSERT_EQ(bytes.substr(address_len_at, 4), std::string("\x05\0\0\0", 4));
  bytes.replace(address_len_at, 4, "\xff\xff\xff\xff");
  r = ParseDescriptor(bytes);
  EXPECT_NE(r.status().message().find("field 'address' is 4294967295 bytes; at most 1048576"),
            std::string::npos)
      << r.status().ToString();
}

TEST(DescriptorV2, RefusesAnUnknownVersion) {
  for (uint32_t version : {0u, 3u}) {
    std::string bytes = SerializeDescriptor(Sample());
    bytes[4] = static_cast<char>(version);
    bytes.resize(bytes.size() - 8);
    const uint64_t sum = XXH3_64bits(bytes.data(), bytes.size());
    for (int i = 0; i < 8; ++i) bytes.push_back(static_cast<char>((sum >> (8 * i)) & 0xff));
    auto r = ParseDescriptor(bytes);
    EXPECT_NE(r.status().message().find(fmt::format("version {} unsupported (this build reads 1 to 2)",
                                                    version)),
              std::string::npos)
        << r.status().ToString();
  }
}

TEST(ProcessIdentity, LocalIdentityIsThisProcessAsProcShowsIt) {
  const ProcessIdentity& self = LocalProcessIdentity();
  ASSERT_TRUE(self.known());
  EXPECT_EQ(self.pid, static_cast<uint32_t>(getpid()));
  struct stat ns {};
  ASSERT_EQ(stat("/proc/self/ns/pid", &ns), 0);
  EXPECT_EQ(self.pid_namespace, ns.st_ino);
  std::ifstream boot("/proc/sys/kernel/random/boot_id");
  std::string boot_id;
  boot >> boot_id;
  EXPECT_EQ(self.boot_id, boot_id);
  EXPECT_EQ(self.boot_id.size(), 36u);
  char state = 0;
  uint64_t start = 0;
  ASSERT_TRUE(ParseProcStat(ProcStatLine(getpid()), &state, &start));
  EXPECT_EQ(self.start_time_ticks, start);
  EXPECT_TRUE(self.SameHostAndNamespace(self));
  ProcessIdentity other_boot = self, other_ns = self;
  other_boot.boot_id[0] = self.boot_id[0] == '0' ? '1' : '0';
  other_ns.pid_namespace += 1;
  EXPECT_FALSE(other_boot.SameHostAndNamespace(self));
  EXPECT_FALSE(other_ns.SameHostAndNamespace(self));
}

TEST(ProcessIdentity, ParsesStatWhateverTheCommandName) {
  char state = 0;
  uint64_t start = 0;
  uint32_t pid = 0;
  // Fields 4..21 are 1..18, field 22 (start time) 987654321.
  std::string tail = " T";
  for (int f = 4; f <= 21; ++f) tail += fmt::format(" {}", f - 3);
  tail += " 987654321 42 7";
  ASSERT_TRUE(ParseProcStat(std::string("4711 (a) b (c) d)") + tail, &state, &start, &pid));
  EXPECT_EQ(state, 'T');
  EXPECT_EQ(start, 987654321u);
  EXPECT_EQ(pid, 4711u);
  EXPECT_FALSE(ParseProcStat("", &state, &start));
  EXPECT_FALSE(ParseProcStat("4711 (x) S 1 2 3", &state, &start));            // too short
  EXPECT_FALSE(ParseProcStat(std::string("4711 (x") + tail, &state, &start));               // no ')'
  EXPECT_FALSE(ParseProcStat(std::string("x (a)") + tail, &state, &start, &pid));           // no pid
  std::string bad = std::string("1 (a)") + tail;
  bad.replace(bad.find("987654321"), 9, "98765432z");
  EXPECT_FALSE(ParseProcStat(bad, &state, &start));  // start time not a number
}

// Alive, a zombie (killed, not reaped: dead), reaped (gone) and a pid that
// names a process started at another time.
TEST(ProcessIdentity, LivenessTellsAliveFromExitedAndReused) {
  const ProcessIdentity& self = LocalProcessIdentity();
  EXPECT_EQ(CheckLiveness(self), Liveness::kAlive);
  ProcessIdentity reused = self;
  reused.start_time_ticks += 1;
  EXPECT_EQ(CheckLiveness(reused), Liveness::kPidReused);

  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) _exit(0);
  char state = 0;
  uint64_t start = 0;
  ASSERT_TRUE(WaitFor([&] { return ParseProcStat(ProcStatLine(child), &state, &start) && state == 'Z'; }))
      << "the child never became a zombie";
  ProcessIdentity gone = self;
  gone.pid = static_cast<uint32_t>(child);
  gone.start_time_ticks = start;
  EXPECT_EQ(CheckLiveness(gone), Liveness::kExited) << "a zombie counted as alive";
  ASSERT_EQ(waitpid(child, nullptr, 0), child);
  EXPECT_EQ(CheckLiveness(gone), Liveness::kExited);
}

// The fault hook's stop (stop_peer_at_import): the process is stopped once
// it returns; itself and unknown identities are refused.
TEST(ProcessIdentity, StopLocalProcessStopsAnotherProcessOnly) {
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    for (int i = 0; i < 600; ++i) sleep(1);  // killed by the test
    _exit(0);
  }
  char state = 0;
  uint64_t start = 0;
  ASSERT_TRUE(ParseProcStat(ProcStatLine(child), &state, &start));
  ProcessIdentity id = LocalProcessIdentity();
  id.pid = static_cast<uint32_t>(child);
  id.start_time_ticks = start;
  const Status s = StopLocalProcess(id);
  EXPECT_TRUE(s.ok()) << s.ToString();
  ASSERT_TRUE(ParseProcStat(ProcStatLine(child), &state, &start));
  EXPECT_EQ(state, 'T');
  EXPECT_EQ(CheckLiveness(id), Liveness::kAlive) << "a stopped process is alive";
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
  EXPECT_EQ(StopLocalProcess(LocalProcessIdentity()).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(StopLocalProcess(ProcessIdentity{}).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(StopLocalProcess(id).code(), StatusCode::kFailedPrecondition);  // gone now

  auto f = ParseKvFault("stop_peer_at_import=2,agent=decode-0");
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ(f->stop_peer_at_import, 2u);
  EXPECT_TRUE(f->enabled());
}

}  // namespace
}  // namespace tandem::kvtransfer
