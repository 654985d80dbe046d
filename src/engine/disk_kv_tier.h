// The disk KV tier: one file per block under a directory, written in one
// sequential write of the whole file (header + payload) with O_DIRECT where
// the file system supports it (a probe at Open; tmpfs before Linux 6.6 and
// some network file systems refuse it: buffered I/O, with the reason logged
// once), to a temporary name and renamed into place, so a crash leaves
// either no file or a whole one.
//
// File `<hash as 16 hex digits>.kvb`, all integers little-endian:
//   0   magic "TANDEMKV"           8 bytes
//   8   version (1)                u32
//   12  header_bytes               u32  64 + 4 * block_size, rounded up to 4096
//   16  fingerprint                u64  of the hash context and the KV layout
//   24  block hash                 u64
//   32  parent hash                u64
//   40  num_tokens (block_size)    u32
//   44  reserved (0)               u32
//   48  payload_bytes              u64  one block of the KV pool
//   56  checksum                   u64  XXH3-64 of the header (this field 0)
//                                       followed by the payload
//   64  token ids                  u32 [num_tokens]
//   header_bytes: payload, zero-padded to a multiple of 4096.
//
// Open() scans the directory: a file whose size, magic, version, geometry,
// fingerprint or name does not match is discarded (deleted) with a warning;
// the rest are indexed (least recently modified evicted first) and survive a
// restart of a worker with the same hash context. Read() verifies the whole
// checksum and the token ids; a torn or corrupted file is discarded with a
// warning and reported as DATA_LOSS, never used.
//
// Thread-safety: none; owned by TieredKvStore, which runs under the engine
// lock.
#pragma once

#include <cstddef>
#include <cstdint>
#include <list>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/status.h"
#include "engine/kv_tier.h"

namespace tandem::engine {

struct DiskTierOptions {
  std::string path;            // created when missing
  uint64_t max_bytes = 0;      // capacity = max_bytes / file size, at least 1 block
  uint32_t block_size = 16;    // tokens per block
  size_t block_bytes = 0;      // KV bytes per block
  uint64_t fingerprint = 0;    // DiskTierFingerprint(...)
  bool try_direct_io = true;   // false: buffered I/O without probing (tests)
};

// Fingerprint of what makes a stored block valid for this worker: the root
// hash (model, revision, block size, KV dtype, fleet salt) and the layout.
uint64_t DiskTierFingerprint(uint64_t root_hash, size_t block_bytes, uint32_t block_size);

class DiskKvTier {
 public:
  static Result<std::unique_ptr<DiskKvTier>> Open(const DiskTierOptions& options);
  ~DiskKvTier();
  DiskKvTier(const DiskKvTier&) = delete;
  DiskKvTier& operator=(const DiskKvTier&) = delete;

  uint64_t capacity() const { return capacity_; }
  uint64_t size() const { return index_.size(); }
  bool full() const { return index_.size() >= capacity_; }
  size_t file_bytes() const { return file_bytes_; }
  bool direct_io() const { return direct_io_; }
  // Files discarded by Open() and Read() (torn, truncated, foreign, corrupt).
  uint64_t discarded() const { return discarded_; }

  bool Contains(uint64_t hash) const { return index_.count(hash) != 0; }
  // True when `hash` is indexed with these token ids.
  bool Find(uint64_t hash, std::span<const uint32_t> tokens) const;

  // Writes a block (the caller evicts first when full(): LeastRecent + Erase).
  Status Write(const TierBlockMeta& meta, std::span<const std::byte> bytes);
  // Reads and verifies the block into `out` (block_bytes); marks it most
  // recently used. DATA_LOSS (file discarded) when it fails verification.
  Status Read(uint64_t hash, std::span<const uint32_t> tokens, std::span<std::byte> out);
  std::optional<uint64_t> LeastRecent() const;
  // Chain parent of an indexed block (0 when absent).
  uint64_t Parent(uint64_t hash) const {
    auto it = index_.find(hash);
    return it == index_.end() ? 0 : it->second.parent;
  }
  // Deletes the file of `hash` (no-op when absent).
  void Erase(uint64_t hash);
  // Deletes every block file.
  void Clear();
  // Every block held (hash, parent).
  std::vector<std::pair<uint64_t, uint64_t>> Entries() const;

  std::string FilePath(uint64_t hash) const;

 private:
  struct Entry {
    uint64_t parent = 0;
    std::vector<uint32_t> tokens;
    std::list<uint64_t>::iterator lru;
  };
  explicit DiskKvTier(const DiskTierOptions& options);
  Status Scan();
  // Validates the header of a file already read (at least header_bytes_).
  Status CheckHeader(std::span<const std::byte> head, uint64_t expect_hash, TierBlockMeta* meta) const;
  int OpenFile(const std::string& path, int flags) const;
  void Discard(const std::string& path, const std::string& why);

  const DiskTierOptions options_;
  uint32_t header_bytes_ = 0;
  size_t file_bytes_ = 0;
  uint64_t capacity_ = 0;
  bool direct_io_ = false;
  uint64_t discarded_ = 0;
  std::byte* buf_ = nullptr;  // [file_bytes_], 4096-aligned
  std::list<uint64_t> lru_;   // front: least recent
  std::unordered_map<uint64_t, Entry> index_;
};

}  // namespace tandem::engine
