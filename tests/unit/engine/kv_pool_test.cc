// The KV pool is resident after start-up (cache.prefault, issue 23): no page
// fault per new block on the decode step. Residency is read with mincore()
// on shared anonymous memory (shmem, the kind UCX's ucp_mem_map hands the
// sim and cpu workers).
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <vector>

#include "engine/kv_pool.h"
#include "test_models.h"

namespace tandem::engine {
namespace {

size_t PageSize() { return static_cast<size_t>(sysconf(_SC_PAGESIZE)); }

// A MAP_SHARED anonymous mapping (shmem), unmapped at the end.
class SharedMapping {
 public:
  explicit SharedMapping(size_t bytes) : bytes_(bytes) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (p != MAP_FAILED) data_ = static_cast<std::byte*>(p);
  }
  ~SharedMapping() {
    if (data_ != nullptr) munmap(data_, bytes_);
  }
  SharedMapping(const SharedMapping&) = delete;
  SharedMapping& operator=(const SharedMapping&) = delete;
  std::byte* data() const { return data_; }
  size_t size() const { return bytes_; }

  // One flag per page: resident or not.
  std::vector<bool> Resident() const {
    std::vector<unsigned char> v((bytes_ + PageSize() - 1) / PageSize());
    EXPECT_EQ(mincore(data_, bytes_, v.data()), 0) << std::strerror(errno);
    std::vector<bool> out(v.size());
    for (size_t i = 0; i < v.size(); ++i) out[i] = (v[i] & 1) != 0;
    return out;
  }
  size_t ResidentPages() const {
    size_t n = 0;
    for (bool r : Resident()) n += r ? 1 : 0;
    return n;
  }

 private:
  std::byte* data_ = nullptr;
  size_t bytes_;
};

// Hands out (a prefix of) a shared mapping, like the transport's allocator.
class SharedAllocator final : public KvPoolAllocator {
 public:
  explicit SharedAllocator(SharedMapping& m) : m_(m) {}
  Result<std::span<std::byte>> Allocate(size_t bytes) override {
    if (bytes > m_.size()) return InternalError("SharedAllocator: mapping too small");
    return std::span<std::byte>(m_.data(), bytes);
  }

 private:
  SharedMapping& m_;
};

TEST(PrefaultMemory, MakesEveryPageResidentAndKeepsTheBytes) {
  const size_t page = PageSize();
  SharedMapping m(64 * page);
  ASSERT_NE(m.data(), nullptr);
  EXPECT_EQ(m.ResidentPages(), 0u);
  m.data()[5 * page + 7] = std::byte{0x5a};  // one page already written
  EXPECT_EQ(m.ResidentPages(), 1u);
  ASSERT_TRUE(PrefaultMemory({m.data(), m.size()}).ok());
  EXPECT_EQ(m.ResidentPages(), 64u);
  EXPECT_EQ(m.data()[5 * page + 7], std::byte{0x5a});
  for (size_t i = 0; i < m.size(); i += 97) {
    if (i != 5 * page + 7) {
      ASSERT_EQ(m.data()[i], std::byte{0}) << i;
    }
  }
}

TEST(PrefaultMemory, UnalignedRangeTouchesOnlyItsPages) {
  const size_t page = PageSize();
  SharedMapping m(8 * page);
  ASSERT_NE(m.data(), nullptr);
  // From inside page 1 to inside page 5: pages 1..5, not 0, 6 or 7.
  ASSERT_TRUE(PrefaultMemory({m.data() + page + 100, 4 * page}).ok());
  const std::vector<bool> r = m.Resident();
  const std::vector<bool> want = {false, true, true, true, true, true, false, false};
  EXPECT_EQ(r, want);
  // Within one page.
  SharedMapping small(2 * page);
  ASSERT_NE(small.data(), nullptr);
  ASSERT_TRUE(PrefaultMemory({small.data() + page + 8, 16}).ok());
  EXPECT_EQ(small.Resident(), (std::vector<bool>{false, true}));
  EXPECT_TRUE(PrefaultMemory({}).ok());
}

// Engine::Create makes the whole pool resident with prefault_kv_pool (the
// default; cache.prefault), and leaves it untouched without.
TEST(KvPoolPrefault, EngineCreateMakesThePoolResidentUnlessOff) {
  const auto& model = testing::TinyModel();
  for (const bool prefault : {true, false}) {
    EngineOptions o;
    o.num_blocks = 64;
    o.prefault_kv_pool = prefault;
    KvLayout l;
    l.num_layers = model.config.num_hidden_layers;
    l.num_kv_heads = model.config.num_key_value_heads;
    l.head_dim = model.config.head_dim;
    l.block_size = o.block_size;
    const size_t pool_bytes = l.block_bytes() * o.num_blocks;
    ASSERT_GE(pool_bytes, 4 * PageSize());
    SharedMapping m(pool_bytes);
    ASSERT_NE(m.data(), nullptr);
    SharedAllocator alloc(m);
    o.allocator = &alloc;
    auto engine = testing::MakeEngine(model, o);
    ASSERT_NE(engine, nullptr);
    const size_t pages = (pool_bytes + PageSize() - 1) / PageSize();
    EXPECT_EQ(m.ResidentPages(), prefault ? pages : 0u) << "prefault " << prefault;
    engine.reset();
  }
}

TEST(KvPoolPrefault, FleetConfigCarriesTheKey) {
  FleetConfig f;
  EXPECT_TRUE(EngineOptions::FromFleetConfig(f).prefault_kv_pool);
  f.cache.prefault = false;
  EXPECT_FALSE(EngineOptions::FromFleetConfig(f).prefault_kv_pool);
}

}  // namespace
}  // namespace tandem::engine
