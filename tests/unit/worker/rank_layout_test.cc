// Issue 18: a role section's rank layout checked against the model, the
// error naming the key (the launcher and the worker refuse with it).
#include "worker/rank_layout.h"

#include <gtest/gtest.h>

namespace tandem::worker {
namespace {

// The bundled model's dimensions (models/tandem-kjv/config.json).
model::ModelConfig Kjv() {
  model::ModelConfig c;
  c.num_hidden_layers = 5;
  c.num_attention_heads = 8;
  c.num_key_value_heads = 2;
  c.intermediate_size = 688;
  c.vocab_size = 4096;
  return c;
}

TEST(RankLayout, GoodLayoutsPass) {
  for (const parallel::ParallelLayout l : {parallel::ParallelLayout{1, 1}, {2, 1}, {4, 1}, {1, 2},
                                           {2, 2}, {1, 5}}) {
    EXPECT_TRUE(CheckRoleLayout("decode", l, Kjv(), "models/tandem-kjv").ok()) << ToString(l);
  }
}

TEST(RankLayout, BadLayoutNamesTheKeyAndTheLimit) {
  Status s = CheckRoleLayout("decode", {3, 1}, Kjv(), "models/tandem-kjv");
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(),
            "decode.tensor_parallel 3 does not divide num_attention_heads 8 (model "
            "models/tandem-kjv)");
  s = CheckRoleLayout("prefill", {1, 6}, Kjv(), "m");
  EXPECT_EQ(s.message(), "prefill.pipeline_parallel 6 exceeds num_hidden_layers 5 (model m)");
}

TEST(RankLayout, ProcessesPerWorker) {
  FleetConfig f;
  f.decode.tensor_parallel = 2;
  f.decode.pipeline_parallel = 2;
  f.prefill.tensor_parallel = 2;
  EXPECT_EQ(RankProcesses(f, "decode"), 4u);
  EXPECT_EQ(RankProcesses(f, "prefill"), 2u);
  EXPECT_EQ(RankProcesses(f, "both"), 1u);
  EXPECT_EQ(RoleLayout(f, "decode"), (parallel::ParallelLayout{2, 2}));
  f.model.backend = "sim";  // the sim models its ranks inside one process
  EXPECT_EQ(RankProcesses(f, "decode"), 1u);
  EXPECT_EQ(RoleLayout(f, "decode"), (parallel::ParallelLayout{2, 2}));
}

}  // namespace
}  // namespace tandem::worker
