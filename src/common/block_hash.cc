#include "common/block_hash.h"

#include <openssl/evp.h>
#include <xxhash.h>

#include <bit>
#include <cstring>

#include "common/check.h"
#include "common/config.h"

namespace tandem {
namespace {

void AppendU32(std::string& buf, uint32_t v) {
  for (int i = 0; i < 4; ++i) buf.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

void AppendField(std::string& buf, const std::string& s) {
  AppendU32(buf, static_cast<uint32_t>(s.size()));
  buf += s;
}

}  // namespace

HashContext HashContextFromFleet(const FleetConfig& fleet) {
  HashContext c;
  c.model_id = fleet.model.name;
  c.revision = fleet.model.revision;
  c.block_size = fleet.cache.block_size;
  c.kv_dtype = KvDtypeForBackend(fleet.model.backend);
  c.fleet_salt = fleet.cache.salt;
  return c;
}

std::string KvDtypeForBackend(std::string_view backend) {
  // The cuda backend keeps bf16 KV (docs/cuda.md); cpu and sim keep f32.
  return backend == "cuda" ? "bf16" : "f32";
}

std::string FleetSaltFingerprint(std::string_view salt) {
  static constexpr std::string_view kDomain = "tandem.fleet-salt.v1";
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_MD_CTX* ctx = EVP_MD_CTX_new();
  const bool ok = ctx != nullptr && EVP_DigestInit_ex(ctx, EVP_sha256(), nullptr) == 1 &&
                  EVP_DigestUpdate(ctx, kDomain.data(), kDomain.size()) == 1 &&
                  EVP_DigestUpdate(ctx, salt.data(), salt.size()) == 1 &&
                  EVP_DigestFinal_ex(ctx, digest, &len) == 1 && len >= 16;
  EVP_MD_CTX_free(ctx);
  TANDEM_CHECK(ok);  // SHA-256 of a few bytes fails only if OpenSSL itself is broken
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  for (unsigned int i = 0; i < 16; ++i) {
    out.push_back(kHex[digest[i] >> 4]);
    out.push_back(kHex[digest[i] & 15]);
  }
  return out;
}

uint64_t RootHash(const HashContext& ctx) {
  std::string buf = "tandem.kv.v1";
  AppendField(buf, ctx.model_id);
  AppendField(buf, ctx.revision);
  AppendU32(buf, ctx.block_size);
  AppendField(buf, ctx.kv_dtype);
  AppendField(buf, ctx.fleet_salt);
  AppendField(buf, ctx.tenant_salt);
  return XXH3_64bits_withSeed(buf.data(), buf.size(), 0);
}

uint64_t HashBlock(uint64_t parent, std::span<const uint32_t> tokens) {
  if constexpr (std::endian::native == std::endian::little) {
    return XXH3_64bits_withSeed(tokens.data(), tokens.size_bytes(), parent);
  } else {
    std::vector<uint8_t> le(tokens.size_bytes());
    for (size_t i = 0; i < tokens.size(); ++i) {
      for (int b = 0; b < 4; ++b) le[i * 4 + b] = static_cast<uint8_t>(tokens[i] >> (8 * b));
    }
    return XXH3_64bits_withSeed(le.data(), le.size(), parent);
  }
}

std::vector<uint64_t> HashBlocks(uint64_t root, std::span<const uint32_t> tokens,
                                 uint32_t block_size) {
  TANDEM_CHECK(block_size > 0);
  const size_t n = tokens.size() / block_size;
  std::vector<uint64_t> out;
  out.reserve(n);
  uint64_t parent = root;
  for (size_t i = 0; i < n; ++i) {
    parent = HashBlock(parent, tokens.subspan(i * block_size, block_size));
    out.push_back(parent);
  }
  return out;
}

}  // namespace tandem
