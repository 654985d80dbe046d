// Chained block hashes of DESIGN.md section 4. Every component (proxy,
// router, workers) hashes with these functions and nothing else.
//
//   h_{-1} = RootHash(context)         model, revision, block size, KV dtype,
//                                      fleet salt, tenant salt
//   h_i    = XXH3_64(tokens_i as little-endian u32, seed = h_{i-1})
//
// Only full blocks are hashed.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace tandem {

struct HashContext {
  std::string model_id;
  std::string revision;
  uint32_t block_size = 16;
  std::string kv_dtype = "f32";
  std::string fleet_salt;   // per-fleet secret: outsiders cannot craft collisions
  std::string tenant_salt;  // optional per tenant / LoRA adapter
};

struct FleetConfig;
// The hash context every component of a fleet derives from its fleet file
// (model name and revision, block size, KV dtype, cache salt), so that the
// proxy, the router and the workers agree on every block's hash.
HashContext HashContextFromFleet(const FleetConfig& fleet);

// h_{-1}: XXH3_64 (seed 0) of "tandem.kv.v1" followed by each string field as
// u32 little-endian length + bytes, and block_size as u32 little-endian, in
// the order model_id, revision, block_size, kv_dtype, fleet_salt, tenant_salt.
uint64_t RootHash(const HashContext& ctx);

// One link of the chain: XXH3_64 of `tokens` as little-endian u32, seeded
// with the parent's hash.
uint64_t HashBlock(uint64_t parent, std::span<const uint32_t> tokens);

// Hashes of every full block of `tokens` (a trailing partial block is not
// hashed). Result has tokens.size() / block_size entries.
std::vector<uint64_t> HashBlocks(uint64_t root, std::span<const uint32_t> tokens,
                                 uint32_t block_size);

}  // namespace tandem
