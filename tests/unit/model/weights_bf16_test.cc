// bf16 weights for the cuda backend (WeightFormat::kBf16): FloatToBfloat16
// against a reference that rounds by comparing distances in double (not by
// bit tricks), over every bf16 boundary of every exponent; and the loader
// path on every stored dtype (the f32 / f16 / bf16 model fixtures, the
// golden fixtures, the bundled model): each matrix element is the
// reference's rounding of the value the f32 path loads, bf16 files are
// copied bit for bit, vectors stay f32 and equal.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "model/model_config.h"
#include "model/safetensors.h"
#include "model/weights.h"
#include "test_util.h"

namespace tandem::model {
namespace {

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// The value of bf16 pattern `b` as a double; the pattern one past the
// largest finite value (infinity) counts as 2^128, where rounding to
// nearest puts the overflow boundary.
double Bf16Value(uint16_t b) {
  if ((b & 0x7fffu) == 0x7f80u) return (b & 0x8000u) ? -std::ldexp(1.0, 128) : std::ldexp(1.0, 128);
  return static_cast<double>(Bfloat16ToFloat(b));
}

// Round to nearest, ties to even, by distance: the two bf16 patterns
// around f are its truncation and the next one away from zero.
uint16_t ReferenceBf16(float f) {
  const uint16_t lo = static_cast<uint16_t>(Bits(f) >> 16);
  if (std::isinf(f)) return lo;
  const uint16_t hi = static_cast<uint16_t>(lo + 1);
  const double v = f;
  const double d_lo = std::fabs(v - Bf16Value(lo));
  const double d_hi = std::fabs(Bf16Value(hi) - v);
  if (d_lo < d_hi) return lo;
  if (d_hi < d_lo) return hi;
  return (lo & 1u) == 0 ? lo : hi;
}

TEST(FloatToBfloat16, NamedValues) {
  EXPECT_EQ(FloatToBfloat16(1.0f), 0x3f80);
  EXPECT_EQ(FloatToBfloat16(-3.0f), 0xc040);
  EXPECT_EQ(FloatToBfloat16(0.0f), 0x0000);
  EXPECT_EQ(FloatToBfloat16(-0.0f), 0x8000);
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1).
  EXPECT_EQ(FloatToBfloat16(FromBits(0x3f808000u)), 0x3f80);
  // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: to even (the latter).
  EXPECT_EQ(FloatToBfloat16(FromBits(0x3f818000u)), 0x3f82);
  EXPECT_EQ(FloatToBfloat16(FromBits(0x3f808001u)), 0x3f81);  // just past halfway: up
  // The largest float rounds to infinity; the largest bf16 stays.
  EXPECT_EQ(FloatToBfloat16(FromBits(0x7f7fffffu)), 0x7f80);
  EXPECT_EQ(FloatToBfloat16(FromBits(0x7f7f0000u)), 0x7f7f);
  EXPECT_EQ(FloatToBfloat16(-INFINITY), 0xff80);
  EXPECT_EQ(FloatToBfloat16(FromBits(0x00000001u)), 0x0000);  // smallest subnormal: to zero
  EXPECT_EQ(FloatToBfloat16(FromBits(0x00008000u)), 0x0000);  // tie at a subnormal: even
  EXPECT_EQ(FloatToBfloat16(FromBits(0x00018000u)), 0x0002);
  // NaN stays NaN, sign kept, even when the payload is all in the low bits.
  for (uint32_t nan : {0x7f800001u, 0x7fc00000u, 0xff800001u, 0xffffffffu}) {
    const uint16_t b = FloatToBfloat16(FromBits(nan));
    EXPECT_TRUE(std::isnan(Bfloat16ToFloat(b))) << std::hex << nan;
    EXPECT_EQ(b & 0x8000u, (nan >> 16) & 0x8000u) << std::hex << nan;
  }
}

TEST(FloatToBfloat16, EveryBoundaryOfEveryExponentMatchesTheReference) {
  std::mt19937 rng(7);
  size_t checked = 0;
  for (uint32_t top = 0; top < 0x10000u; ++top) {
    const uint32_t lows[] = {0x0000u, 0x0001u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu,
                             static_cast<uint32_t>(rng() & 0xffffu)};
    for (uint32_t low : lows) {
      const float f = FromBits(top << 16 | low);
      if (std::isnan(f)) continue;  // NamedValues covers NaN
      ASSERT_EQ(FloatToBfloat16(f), ReferenceBf16(f)) << std::hex << (top << 16 | low);
      ++checked;
    }
  }
  EXPECT_GT(checked, 400000u);
}

TEST(FloatToBfloat16, HalfValuesRoundOnce) {
  // Every f16 value: exact to f32, then one rounding (what ReadBf16 does
  // with an f16 tensor) equals the reference rounding of the value.
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    const float f = HalfToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    ASSERT_EQ(FloatToBfloat16(f), ReferenceBf16(f)) << std::hex << h;
  }
}

// ---- the loader path ----

std::vector<std::pair<std::string, const Matrix*>> Matrices(const ModelWeights& w) {
  std::vector<std::pair<std::string, const Matrix*>> out = {{"embed_tokens", &w.embed_tokens},
                                                             {"lm_head", &w.lm_head}};
  for (size_t i = 0; i < w.layers.size(); ++i) {
    const LayerWeights& l = w.layers[i];
    const std::string p = "layers." + std::to_string(i) + ".";
    for (auto [n, m] : {std::pair{"q_proj", &l.q_proj}, {"k_proj", &l.k_proj}, {"v_proj", &l.v_proj},
                        {"o_proj", &l.o_proj}, {"gate_proj", &l.gate_proj}, {"up_proj", &l.up_proj},
                        {"down_proj", &l.down_proj}}) {
      out.emplace_back(p + n, m);
    }
  }
  return out;
}

std::vector<const std::vector<float>*> Vectors(const ModelWeights& w) {
  std::vector<const std::vector<float>*> out = {&w.norm};
  for (const LayerWeights& l : w.layers) {
    for (const auto* v : {&l.input_layernorm, &l.post_attention_layernorm, &l.q_bias, &l.k_bias,
                          &l.v_bias, &l.o_bias}) {
      out.push_back(v);
    }
  }
  return out;
}

// Loads `dir` both ways and compares every tensor. `stored_bf16`: the file
// holds bf16, so the bf16 load must be the stored bits (rounding is the
// identity and the f32 load is exact).
void ExpectBf16LoadMatchesReference(const std::string& dir, bool stored_bf16) {
  SCOPED_TRACE(dir);
  auto config = LoadModelConfig(dir);
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  auto f32 = LoadWeights(dir, *config);
  ASSERT_TRUE(f32.ok()) << f32.status().ToString();
  auto b16 = LoadWeights(dir, *config, WeightFormat::kBf16);
  ASSERT_TRUE(b16.ok()) << b16.status().ToString();
  const auto want = Matrices(*f32);
  const auto got = Matrices(*b16);
  ASSERT_EQ(want.size(), got.size());
  size_t elems = 0, rounded = 0;
  for (size_t t = 0; t < want.size(); ++t) {
    SCOPED_TRACE(want[t].first);
    const Matrix& a = *want[t].second;
    const Matrix& b = *got[t].second;
    EXPECT_EQ(b.rows, a.rows);
    EXPECT_EQ(b.cols, a.cols);
    EXPECT_TRUE(b.data.empty());
    EXPECT_TRUE(a.bf16.empty());
    ASSERT_EQ(b.bf16.size(), a.data.size());
    for (size_t i = 0; i < a.data.size(); ++i) {
      const uint16_t ref = ReferenceBf16(a.data[i]);
      ASSERT_EQ(b.bf16[i], ref) << "element " << i << " = " << a.data[i];
      if (stored_bf16) {
        ASSERT_EQ(Bfloat16ToFloat(b.bf16[i]), a.data[i]) << "element " << i;
      }
      rounded += Bfloat16ToFloat(ref) != a.data[i];
    }
    elems += a.data.size();
  }
  EXPECT_GT(elems, 1000u);
  if (stored_bf16) {
    EXPECT_EQ(rounded, 0u);
  } else {
    EXPECT_GT(rounded, elems / 2) << "f32/f16 weights should mostly need rounding";
  }
  const auto va = Vectors(*f32);
  const auto vb = Vectors(*b16);
  for (size_t i = 0; i < va.size(); ++i) EXPECT_EQ(*va[i], *vb[i]) << "vector " << i;
}

std::string Src(const std::string& rel) { return std::string(TANDEM_SOURCE_DIR) + "/" + rel; }

TEST(WeightsBf16, F32File) { ExpectBf16LoadMatchesReference(Src("tests/fixtures/model/models/llama_f32"), false); }
TEST(WeightsBf16, Bf16ShardsAreCopiedBitForBit) {
  ExpectBf16LoadMatchesReference(Src("tests/fixtures/model/models/llama_bf16_sharded"), true);
}
TEST(WeightsBf16, F16TiedWithBias) {
  ExpectBf16LoadMatchesReference(Src("tests/fixtures/model/models/qwen2_f16_tied"), false);
}
TEST(WeightsBf16, F16Shards) {
  ExpectBf16LoadMatchesReference(Src("tests/fixtures/model/models/mistral_f16_sharded"), false);
}
TEST(WeightsBf16, GoldenFixtures) {
  for (const char* name : {"tiny-llama", "tiny-llama-bias", "tiny-qwen2"}) {
    ExpectBf16LoadMatchesReference(Src(std::string("tests/fixtures/golden/") + name), false);
  }
}
TEST(WeightsBf16, BundledModel) {
  const std::string dir = Src("models/tandem-kjv");
  if (!std::filesystem::exists(dir + "/config.json")) GTEST_SKIP() << dir << " is absent";
  ExpectBf16LoadMatchesReference(dir, false);
}

}  // namespace
}  // namespace tandem::model
