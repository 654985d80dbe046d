// The block-hash context: one builder for the proxy, the workers and the
// tools (common/block_hash.h), whatever the backend.
#include <gtest/gtest.h>

#include "common/block_hash.h"
#include "common/config.h"
#include "engine/engine.h"

namespace tandem {
namespace {

// One builder: the engine's context (workers, `tandem generate`) is the
// proxy's, and the KV dtype follows the backend (the cuda KV cache is bf16).
TEST(HashContext, EngineAndProxyBuildTheSameContext) {
  for (const char* backend : {"cpu", "cuda", "sim"}) {
    FleetConfig fleet;
    fleet.model.name = "tandem-kjv";
    fleet.model.revision = "r1";
    fleet.model.backend = backend;
    fleet.cache.block_size = 32;
    fleet.cache.salt = "pepper";
    const HashContext proxy = HashContextFromFleet(fleet);
    const HashContext worker = engine::EngineOptions::FromFleetConfig(fleet).hash_context;
    EXPECT_EQ(proxy.kv_dtype, std::string(backend) == "cuda" ? "bf16" : "f32") << backend;
    EXPECT_EQ(worker.kv_dtype, proxy.kv_dtype) << backend;
    EXPECT_EQ(worker.model_id, "tandem-kjv");
    EXPECT_EQ(worker.revision, "r1");
    EXPECT_EQ(worker.fleet_salt, "pepper");
    EXPECT_TRUE(worker.tenant_salt.empty());  // per request, set by the caller
    EXPECT_EQ(proxy.block_size, 32u);
    EXPECT_EQ(RootHash(worker), RootHash(proxy)) << backend;
  }
}

}  // namespace
}  // namespace tandem
