// Lower KV tiers (host memory, disk) under the block manager: blocks move
// down on eviction, prefix hits onboard them with their bytes intact, the
// disk tier survives a reopen, and damaged or foreign files are refused.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <optional>
#include <span>

#include "common/block_hash.h"
#include "engine/block_manager.h"
#include "engine/disk_kv_tier.h"
#include "engine/host_kv_tier.h"
#include "engine/kv_events.h"
#include "engine/kv_pool.h"
#include "engine/tiered_kv_store.h"

namespace tandem::engine {
namespace {

namespace fs = std::filesystem;
constexpr uint32_t kBs = 4;
constexpr uint64_t kRoot = 0x1234;

std::vector<uint32_t> Seq(uint32_t n, uint32_t start) {
  std::vector<uint32_t> v(n);
  std::iota(v.begin(), v.end(), start);
  return v;
}

// A device pool + block manager with optional lower tiers; every block's
// first float is stamped with a value derived from its hash so that a test
// can tell the bytes travelled with the block.
class Fixture {
 public:
  Fixture(uint32_t device_blocks, uint32_t host_blocks, const std::string& disk_dir,
          double disk_blocks = 0)
      : events_(1), bm_(device_blocks, kBs, &events_) {
    layout_.num_layers = 1;
    layout_.num_kv_heads = 1;
    layout_.head_dim = 4;
    layout_.block_size = kBs;
    pool_ = std::move(KvPool::Create(layout_, device_blocks, alloc_).value());
    std::unique_ptr<HostKvTier> host;
    if (host_blocks > 0) host = std::move(HostKvTier::Create(host_blocks, layout_.block_bytes(), kBs).value());
    if (!disk_dir.empty()) disk_ = OpenDisk(disk_dir, disk_blocks);
    bm_.AttachTiers(std::make_unique<TieredKvStore>(std::move(host), std::move(disk_), &events_),
                    pool_.get(), [this](double) { ++onboards_; });
  }

  std::unique_ptr<DiskKvTier> OpenDisk(const std::string& dir, double blocks) {
    DiskTierOptions d;
    d.path = dir;
    d.block_size = kBs;
    d.block_bytes = layout_.block_bytes();
    d.fingerprint = DiskTierFingerprint(kRoot, d.block_bytes, kBs);
    d.max_bytes = static_cast<uint64_t>(blocks * (4096 + 4096));  // one header page + one payload page
    return std::move(DiskKvTier::Open(d).value());
  }

  // Computes (allocates, stamps, commits) and releases a sequence.
  void Run(const std::vector<uint32_t>& tokens) {
    auto hashes = HashBlocks(kRoot, tokens, kBs);
    const uint32_t n = static_cast<uint32_t>(hashes.size());
    auto blocks = bm_.Allocate(n).value();
    for (uint32_t i = 0; i < n; ++i) pool_->block(blocks[i])[0] = Stamp(hashes[i]);
    bm_.Commit(blocks, hashes, tokens, 0, n, kRoot);
    bm_.Release(blocks);
  }
  static float Stamp(uint64_t hash) { return static_cast<float>(hash % 100000); }

  // Acquires the cached prefix, checks the stamps, releases.
  PrefixHit Reuse(const std::vector<uint32_t>& tokens) {
    auto hashes = HashBlocks(kRoot, tokens, kBs);
    PrefixHit hit;
    auto blocks = bm_.AcquireCachedPrefix(hashes, tokens, static_cast<uint32_t>(hashes.size()), &hit);
    for (size_t i = 0; i < blocks.size(); ++i) {
      EXPECT_EQ(pool_->block(blocks[i])[0], Stamp(hashes[i])) << "block " << i;
    }
    bm_.Release(blocks);
    return hit;
  }

  // Events since the last call, as (kind, tier, number of hashes).
  std::vector<std::tuple<KvEventKind, KvTier, size_t>> Events() {
    std::vector<std::tuple<KvEventKind, KvTier, size_t>> out;
    for (const KvEvent& e : events_.Drain()) out.emplace_back(e.kind, e.tier, e.hashes.size());
    return out;
  }

  KvEventPublisher events_;
  BlockManager bm_;
  KvLayout layout_;
  AlignedKvPoolAllocator alloc_;
  std::unique_ptr<KvPool> pool_;
  std::unique_ptr<DiskKvTier> disk_;
  int onboards_ = 0;
};

class TempDir {
 public:
  TempDir() {
    path_ = fs::temp_directory_path() /
            ("tandem_kv_tiers_" + std::to_string(::getpid()) + "_" + std::to_string(counter_++));
    fs::remove_all(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  std::string str() const { return path_.string(); }
  std::vector<fs::path> Files() const {
    std::vector<fs::path> v;
    if (!fs::exists(path_)) return v;
    for (const auto& e : fs::directory_iterator(path_)) v.push_back(e.path());
    std::sort(v.begin(), v.end());
    return v;
  }

 private:
  static inline int counter_ = 0;
  fs::path path_;
};

TEST(KvTiersTest, DeviceEvictionMovesToHostAndAHitOnboardsIt) {
  Fixture f(4, 8, "");
  const auto a = Seq(16, 100), b = Seq(16, 500);  // 4 blocks each: the device holds one
  f.Run(a);
  f.Events();
  f.Run(b);  // evicts a's 4 blocks to the host tier
  EXPECT_EQ(f.bm_.evictions(KvTier::kDevice), 4u);
  EXPECT_EQ(f.bm_.tiers()->host()->size(), 4u);
  auto ev = f.Events();
  // removed(device) x4, stored(host) x4, then b's stored(device) x4
  ASSERT_EQ(ev.size(), 3u);
  EXPECT_EQ(ev[0], std::make_tuple(KvEventKind::kRemoved, KvTier::kDevice, size_t{4}));
  EXPECT_EQ(ev[1], std::make_tuple(KvEventKind::kStored, KvTier::kHost, size_t{4}));
  EXPECT_EQ(ev[2], std::make_tuple(KvEventKind::kStored, KvTier::kDevice, size_t{4}));

  auto ha = HashBlocks(kRoot, a, kBs);
  EXPECT_EQ(f.bm_.CountCachedPrefix(ha, a, 4), 4u);
  const PrefixHit hit = f.Reuse(a);  // stamps checked inside
  EXPECT_EQ(hit.blocks[0], 0u);
  EXPECT_EQ(hit.blocks[1], 4u);
  EXPECT_EQ(f.onboards_, 1);
  // a is on the device again, b moved down; host and device stay disjoint.
  EXPECT_EQ(f.bm_.tiers()->host()->size(), 4u);
  const PrefixHit again = f.Reuse(a);
  EXPECT_EQ(again.blocks[0], 4u);
  EXPECT_EQ(f.Reuse(b).blocks[1], 4u);
}

// The host tier keeps each block's XXH3-64 from when it moved down and
// checks it when the block is read back: a damaged block is dropped (the
// prefix hit stops before it) and never onboarded.
TEST(KvTiersTest, HostTierBlockThatFailsItsChecksumIsNeverOnboarded) {
  Fixture f(4, 8, "");
  const auto a = Seq(16, 100);
  f.Run(a);
  f.Run(Seq(16, 500));  // a's 4 blocks to the host tier
  HostKvTier& host = *f.bm_.tiers()->host();
  ASSERT_EQ(host.size(), 4u);
  auto ha = HashBlocks(kRoot, a, kBs);
  // Damage a's third block in host memory (a stray write, bad DIMM...).
  std::optional<uint32_t> slot = host.Find(ha[2], std::span(a).subspan(2 * kBs, kBs));
  ASSERT_TRUE(slot.has_value());
  EXPECT_TRUE(host.Verify(*slot));
  const_cast<std::byte*>(host.bytes(*slot).data())[5] ^= std::byte{0x10};
  EXPECT_FALSE(host.Verify(*slot));
  PrefixHit hit;
  auto blocks = f.bm_.AcquireCachedPrefix(ha, a, 4, &hit);
  EXPECT_EQ(blocks.size(), 2u) << "the prefix hit must stop at the damaged block";
  for (size_t i = 0; i < blocks.size(); ++i) {
    EXPECT_EQ(f.pool_->block(blocks[i])[0], Fixture::Stamp(ha[i]));
  }
  f.bm_.Release(blocks);
  EXPECT_FALSE(host.Contains(ha[2])) << "the damaged block stayed in the host tier";
}

TEST(KvTiersTest, LowerTierChecksTokenIds) {
  Fixture f(4, 8, "");
  const auto a = Seq(16, 100);
  f.Run(a);
  f.Run(Seq(16, 500));
  auto ha = HashBlocks(kRoot, a, kBs);
  auto other = a;
  other[9] = 7;  // block 2 differs under the same hashes (a collision)
  EXPECT_EQ(f.bm_.CountCachedPrefix(ha, other, 4), 2u);
  PrefixHit hit;
  auto blocks = f.bm_.AcquireCachedPrefix(ha, other, 4, &hit);
  EXPECT_EQ(blocks.size(), 2u);
  f.bm_.Release(blocks);
}

TEST(KvTiersTest, HostOverflowGoesToDiskAndDiskSurvivesAReopen) {
  TempDir dir;
  const auto a = Seq(16, 100), b = Seq(16, 500), c = Seq(16, 900);
  {
    Fixture f(4, 4, dir.str(), 16);
    f.Run(a);
    f.Run(b);  // a -> host
    f.Run(c);  // b -> host, a -> disk
    EXPECT_EQ(f.bm_.tiers()->disk()->size(), 4u);
    EXPECT_EQ(f.bm_.evictions(KvTier::kHost), 4u);
    const PrefixHit hit = f.Reuse(a);
    EXPECT_EQ(hit.blocks[2], 4u);
    // Inclusive: a's files stay; making room for a pushed c to host and b to disk.
    EXPECT_EQ(f.bm_.tiers()->disk()->size(), 8u);
  }
  EXPECT_EQ(dir.Files().size(), 8u);
  // A new worker on the same directory and hash context finds and reuses them.
  Fixture g(4, 0, dir.str(), 16);
  EXPECT_EQ(g.bm_.tiers()->disk()->size(), 8u);
  EXPECT_EQ(g.bm_.Snapshot().blocks.size(), 8u);
  EXPECT_EQ(g.Reuse(a).blocks[2], 4u);
  EXPECT_EQ(g.Reuse(b).blocks[2], 4u);
  EXPECT_EQ(g.Reuse(c).total(), 0u);  // c never reached the disk
}

TEST(KvTiersTest, CorruptedTruncatedAndForeignFilesAreRefused) {
  TempDir dir;
  const auto a = Seq(16, 100);
  {
    Fixture f(4, 0, dir.str(), 16);
    f.Run(a);
    f.Run(Seq(16, 500));  // a -> disk
  }
  auto files = dir.Files();
  ASSERT_EQ(files.size(), 4u);
  const auto ha = HashBlocks(kRoot, a, kBs);
  auto file_of = [&](uint64_t h) {
    char name[32];
    std::snprintf(name, sizeof(name), "%016llx.kvb", static_cast<unsigned long long>(h));
    return fs::path(dir.str()) / name;
  };
  // Block 3: truncated. Block 2: one payload byte flipped (found only when read).
  fs::resize_file(file_of(ha[3]), fs::file_size(file_of(ha[3])) - 100);
  {
    std::fstream io(file_of(ha[2]), std::ios::in | std::ios::out | std::ios::binary);
    io.seekp(4096 + 1);
    io.put('\x5a');
  }
  // A stray temporary file (a write torn by a crash).
  std::ofstream(fs::path(dir.str()) / "00000000000000aa.kvb.tmp") << "partial";

  Fixture g(4, 0, dir.str(), 16);
  EXPECT_EQ(g.bm_.tiers()->disk()->discarded(), 2u);  // truncated + temporary
  EXPECT_EQ(g.bm_.tiers()->disk()->size(), 3u);
  EXPECT_EQ(g.bm_.CountCachedPrefix(ha, a, 4), 3u);  // headers look fine
  const PrefixHit hit = g.Reuse(a);                  // the corrupted block is refused on read
  EXPECT_EQ(hit.blocks[2], 2u);
  EXPECT_EQ(g.bm_.tiers()->disk()->discarded(), 3u);
  EXPECT_FALSE(fs::exists(file_of(ha[2])));
  EXPECT_EQ(g.bm_.CountCachedPrefix(ha, a, 4), 2u);
  EXPECT_EQ(g.bm_.num_free_blocks(), 4u);  // nothing left held

  // Another hash context (a foreign file): every file is discarded.
  DiskTierOptions d;
  d.path = dir.str();
  d.block_size = kBs;
  d.block_bytes = g.layout_.block_bytes();
  d.fingerprint = DiskTierFingerprint(kRoot + 1, d.block_bytes, kBs);
  d.max_bytes = 1 << 20;
  auto foreign = DiskKvTier::Open(d);
  ASSERT_TRUE(foreign.ok()) << foreign.status().ToString();
  EXPECT_EQ((*foreign)->size(), 0u);
  EXPECT_EQ((*foreign)->discarded(), 2u);
}

TEST(KvTiersTest, DiskCapacityEvictsTheOldestFile) {
  TempDir dir;
  Fixture f(4, 0, dir.str(), 6);  // 6 files
  f.Run(Seq(16, 100));
  f.Run(Seq(16, 500));  // 4 files
  f.Events();
  f.Run(Seq(16, 900));  // 4 more: 2 of the first sequence's files go
  EXPECT_EQ(f.bm_.tiers()->disk()->size(), 6u);
  EXPECT_EQ(f.bm_.evictions(KvTier::kDisk), 2u);
  EXPECT_EQ(dir.Files().size(), 6u);
  size_t removed_disk = 0;
  for (auto& [kind, tier, n] : f.Events()) {
    if (kind == KvEventKind::kRemoved && tier == KvTier::kDisk) removed_disk += n;
  }
  EXPECT_EQ(removed_disk, 2u);
}

// Both I/O paths work: O_DIRECT where the probe succeeds (here: /tmp) and
// buffered I/O (forced here; what a file system refusing O_DIRECT gets).
TEST(KvTiersTest, DiskTierWorksWithAndWithoutODirect) {
  for (bool direct : {true, false}) {
    SCOPED_TRACE(direct ? "O_DIRECT allowed" : "buffered");
    TempDir dir;
    Fixture f(4, 0, "");
    DiskTierOptions d;
    d.path = dir.str();
    d.block_size = kBs;
    d.block_bytes = f.layout_.block_bytes();
    d.fingerprint = DiskTierFingerprint(kRoot, d.block_bytes, kBs);
    d.max_bytes = 1 << 20;
    d.try_direct_io = direct;
    auto t = DiskKvTier::Open(d);
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    if (!direct) {
      EXPECT_FALSE((*t)->direct_io());
    }
    std::vector<std::byte> block(d.block_bytes), back(d.block_bytes);
    for (size_t i = 0; i < block.size(); ++i) block[i] = static_cast<std::byte>(i * 7 + 1);
    TierBlockMeta meta{0xabcdef, 0x1234, Seq(kBs, 3)};
    ASSERT_TRUE((*t)->Write(meta, block).ok());
    ASSERT_TRUE((*t)->Read(meta.hash, meta.tokens, back).ok());
    EXPECT_EQ(back, block);
    EXPECT_EQ((*t)->Read(meta.hash, Seq(kBs, 4), back).code(), StatusCode::kDataLoss);  // other tokens
  }
}

TEST(KvTiersTest, ClearCacheEmptiesEveryTier) {
  TempDir dir;
  Fixture f(4, 4, dir.str(), 16);
  f.Run(Seq(16, 100));
  f.Run(Seq(16, 500));
  f.Run(Seq(16, 900));
  f.bm_.ClearCache();
  EXPECT_EQ(f.bm_.Snapshot().blocks.size(), 0u);
  EXPECT_EQ(dir.Files().size(), 0u);
}

}  // namespace
}  // namespace tandem::engine
