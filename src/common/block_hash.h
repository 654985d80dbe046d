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
#include <string_view>
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
// THE hash context builder: the proxy, the workers and the tools all derive
// their context from the fleet file with this function and nothing else
// (model name and revision, block size, the KV dtype of model.backend, the
// fleet salt cache.salt), so that they agree on every block's hash. The
// tenant salt is per request: it stays empty here and the caller sets it.
HashContext HashContextFromFleet(const FleetConfig& fleet);

// The element type of the KV cache a backend keeps: "bf16" for `cuda`
// (docs/cuda.md), "f32" for `cpu` and `sim`.
std::string KvDtypeForBackend(std::string_view backend);

// A fingerprint of the fleet salt that can be compared without revealing
// it: the first 16 bytes of SHA-256("tandem.fleet-salt.v1" || salt), as 32
// hex digits. Workers send this at registration, never the salt.
std::string FleetSaltFingerprint(std::string_view salt);

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

// A whole prompt's digest (DecodeRequest.prompt_digest, session 39): XXH3_64
// (seed 0) of `tokens` as little-endian u32, i.e. HashBlock(0, tokens). It
// names a prompt the decoder takes from the prefiller's Reserve; not a block
// hash (no context, any length).
inline uint64_t PromptDigest(std::span<const uint32_t> tokens) { return HashBlock(0, tokens); }

}  // namespace tandem
