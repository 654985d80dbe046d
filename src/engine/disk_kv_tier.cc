#include "engine/disk_kv_tier.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>

namespace tandem::engine {
namespace {

namespace fs = std::filesystem;
constexpr char kMagic[8] = {'T', 'A', 'N', 'D', 'E', 'M', 'K', 'V'};
constexpr uint32_t kVersion = 1;
constexpr size_t kAlign = 4096;
constexpr size_t kFixedHeader = 64;
constexpr size_t kChecksumOffset = 56;
constexpr const char* kSuffix = ".kvb";

size_t RoundUp(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

template <typename T>
void Put(std::byte* p, size_t off, T v) {
  std::memcpy(p + off, &v, sizeof(T));
}
template <typename T>
T Get(const std::byte* p, size_t off) {
  T v;
  std::memcpy(&v, p + off, sizeof(T));
  return v;
}

uint64_t Checksum(const std::byte* file, size_t header_bytes, size_t payload_bytes) {
  XXH3_state_t* st = XXH3_createState();
  XXH3_64bits_reset(st);
  XXH3_64bits_update(st, file, kChecksumOffset);
  const uint64_t zero = 0;
  XXH3_64bits_update(st, &zero, sizeof(zero));
  XXH3_64bits_update(st, file + kChecksumOffset + 8, header_bytes - kChecksumOffset - 8);
  XXH3_64bits_update(st, file + header_bytes, payload_bytes);
  const uint64_t h = XXH3_64bits_digest(st);
  XXH3_freeState(st);
  return h;
}

class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

}  // namespace

uint64_t DiskTierFingerprint(uint64_t root_hash, size_t block_bytes, uint32_t block_size) {
  const uint64_t parts[4] = {root_hash, static_cast<uint64_t>(block_bytes), block_size, kVersion};
  return XXH3_64bits(parts, sizeof(parts));
}

DiskKvTier::DiskKvTier(const DiskTierOptions& options) : options_(options) {}

DiskKvTier::~DiskKvTier() { std::free(buf_); }

Result<std::unique_ptr<DiskKvTier>> DiskKvTier::Open(const DiskTierOptions& o) {
  if (o.path.empty()) return InvalidArgumentError("cache.disk_tier.path is empty");
  if (o.block_bytes == 0 || o.block_size == 0) {
    return InvalidArgumentError("disk KV tier: block bytes and block size must be > 0");
  }
  std::unique_ptr<DiskKvTier> t(new DiskKvTier(o));
  t->header_bytes_ = static_cast<uint32_t>(RoundUp(kFixedHeader + 4 * size_t{o.block_size}));
  t->file_bytes_ = t->header_bytes_ + RoundUp(o.block_bytes);
  t->capacity_ = o.max_bytes / t->file_bytes_;
  if (t->capacity_ == 0) {
    return InvalidArgumentError(fmt::format(
        "cache.disk_tier.max_gib: {} bytes hold no block file of {} bytes", o.max_bytes,
        t->file_bytes_));
  }
  std::error_code ec;
  fs::create_directories(o.path, ec);
  if (ec) {
    return FailedPreconditionError(
        fmt::format("cache.disk_tier.path '{}': cannot create: {}", o.path, ec.message()));
  }
  t->buf_ = static_cast<std::byte*>(std::aligned_alloc(kAlign, t->file_bytes_));
  if (t->buf_ == nullptr) return ResourceExhaustedError("disk KV tier: cannot allocate its buffer");
  std::memset(t->buf_, 0, t->file_bytes_);

  // O_DIRECT probe: old tmpfs and some others refuse it (EINVAL).
  const std::string probe = (fs::path(o.path) / ".odirect-probe").string();
  int fd = o.try_direct_io
               ? ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_DIRECT | O_CLOEXEC, 0644)
               : -1;
  if (!o.try_direct_io) errno = 0;
  if (fd >= 0) {
    const ssize_t n = ::pwrite(fd, t->buf_, kAlign, 0);
    t->direct_io_ = n == static_cast<ssize_t>(kAlign);
    if (!t->direct_io_) {
      spdlog::info("disk KV tier at {}: O_DIRECT write failed ({}); using buffered I/O", o.path,
                   std::strerror(errno));
    }
    ::close(fd);
  } else {
    const int err = errno;
    fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
      return FailedPreconditionError(fmt::format("cache.disk_tier.path '{}' is not writable: {}",
                                                 o.path, std::strerror(errno)));
    }
    ::close(fd);
    if (o.try_direct_io) {
      spdlog::info("disk KV tier at {}: O_DIRECT not supported here ({}); using buffered I/O",
                   o.path, std::strerror(err));
    }
  }
  ::unlink(probe.c_str());
  TANDEM_RETURN_IF_ERROR(t->Scan());
  spdlog::info("disk KV tier at {}: {} of {} blocks ({} bytes per file) found valid, {} discarded{}",
               o.path, t->index_.size(), t->capacity_, t->file_bytes_, t->discarded_,
               t->direct_io_ ? ", O_DIRECT" : "");
  return t;
}

int DiskKvTier::OpenFile(const std::string& path, int flags) const {
  return ::open(path.c_str(), flags | O_CLOEXEC | (direct_io_ ? O_DIRECT : 0), 0644);
}

std::string DiskKvTier::FilePath(uint64_t hash) const {
  return (fs::path(options_.path) / fmt::format("{:016x}{}", hash, kSuffix)).string();
}

void DiskKvTier::Discard(const std::string& path, const std::string& why) {
  spdlog::warn("disk KV tier: discarding {}: {}", path, why);
  ::unlink(path.c_str());
  ++discarded_;
}

Status DiskKvTier::CheckHeader(std::span<const std::byte> head, uint64_t expect_hash,
                               TierBlockMeta* meta) const {
  const std::byte* p = head.data();
  if (std::memcmp(p, kMagic, sizeof(kMagic)) != 0) return DataLossError("bad magic (not a tandem KV block file)");
  if (Get<uint32_t>(p, 8) != kVersion) {
    return DataLossError(fmt::format("version {} (this build reads {})", Get<uint32_t>(p, 8), kVersion));
  }
  if (Get<uint32_t>(p, 12) != header_bytes_ || Get<uint32_t>(p, 40) != options_.block_size ||
      Get<uint64_t>(p, 48) != options_.block_bytes) {
    return DataLossError(fmt::format(
        "geometry: header {} bytes, {} tokens, payload {} bytes; this worker: {}, {}, {}",
        Get<uint32_t>(p, 12), Get<uint32_t>(p, 40), Get<uint64_t>(p, 48), header_bytes_,
        options_.block_size, options_.block_bytes));
  }
  if (Get<uint64_t>(p, 16) != options_.fingerprint) {
    return DataLossError("hash context fingerprint differs (another model, revision, salt or layout)");
  }
  if (Get<uint64_t>(p, 24) != expect_hash) return DataLossError("block hash differs from the file name");
  if (meta != nullptr) {
    meta->hash = expect_hash;
    meta->parent = Get<uint64_t>(p, 32);
    meta->tokens.resize(options_.block_size);
    std::memcpy(meta->tokens.data(), p + kFixedHeader, 4 * size_t{options_.block_size});
  }
  return Status::Ok();
}

Status DiskKvTier::Scan() {
  struct Found {
    fs::file_time_type mtime;
    uint64_t hash;
    TierBlockMeta meta;
  };
  std::vector<Found> found;
  std::error_code ec;
  for (const auto& de : fs::directory_iterator(options_.path, ec)) {
    const std::string path = de.path().string();
    const std::string name = de.path().filename().string();
    if (!de.is_regular_file()) continue;
    if (name.ends_with(".tmp")) {
      Discard(path, "an unfinished write (temporary file)");
      continue;
    }
    if (!name.ends_with(kSuffix)) continue;
    const std::string stem = name.substr(0, name.size() - std::strlen(kSuffix));
    char* end = nullptr;
    const uint64_t hash = std::strtoull(stem.c_str(), &end, 16);
    if (stem.size() != 16 || end == nullptr || *end != '\0') {
      Discard(path, "name is not a block hash");
      continue;
    }
    const auto size = de.file_size(ec);
    if (ec || size != file_bytes_) {
      Discard(path, fmt::format("size {} bytes, expected {} (truncated or foreign)",
                                ec ? 0 : size, file_bytes_));
      continue;
    }
    Fd fd(OpenFile(path, O_RDONLY));
    if (fd.get() < 0 || ::pread(fd.get(), buf_, header_bytes_, 0) != static_cast<ssize_t>(header_bytes_)) {
      Discard(path, fmt::format("cannot read its header: {}", std::strerror(errno)));
      continue;
    }
    TierBlockMeta meta;
    if (Status s = CheckHeader({buf_, header_bytes_}, hash, &meta); !s.ok()) {
      Discard(path, std::string(s.message()));
      continue;
    }
    found.push_back({de.last_write_time(ec), hash, std::move(meta)});
  }
  if (ec) {
    return FailedPreconditionError(
        fmt::format("cache.disk_tier.path '{}': cannot list: {}", options_.path, ec.message()));
  }
  std::sort(found.begin(), found.end(), [](const Found& a, const Found& b) { return a.mtime < b.mtime; });
  // Over capacity (max_gib lowered since): the oldest go.
  size_t skip = found.size() > capacity_ ? found.size() - capacity_ : 0;
  for (size_t i = 0; i < found.size(); ++i) {
    if (i < skip) {
      ::unlink(FilePath(found[i].hash).c_str());
      continue;
    }
    Entry e;
    e.parent = found[i].meta.parent;
    e.tokens = std::move(found[i].meta.tokens);
    e.lru = lru_.insert(lru_.end(), found[i].hash);
    index_.emplace(found[i].hash, std::move(e));
  }
  return Status::Ok();
}

bool DiskKvTier::Find(uint64_t hash, std::span<const uint32_t> tokens) const {
  auto it = index_.find(hash);
  return it != index_.end() &&
         std::equal(it->second.tokens.begin(), it->second.tokens.end(), tokens.begin(), tokens.end());
}

Status DiskKvTier::Write(const TierBlockMeta& meta, std::span<const std::byte> bytes) {
  if (bytes.size() != options_.block_bytes || meta.tokens.size() != options_.block_size) {
    return InvalidArgumentError("disk KV tier: block of the wrong size");
  }
  if (index_.count(meta.hash) != 0) return Status::Ok();
  if (full()) return ResourceExhaustedError("disk KV tier full");
  std::memset(buf_, 0, file_bytes_);
  std::memcpy(buf_, kMagic, sizeof(kMagic));
  Put<uint32_t>(buf_, 8, kVersion);
  Put<uint32_t>(buf_, 12, header_bytes_);
  Put<uint64_t>(buf_, 16, options_.fingerprint);
  Put<uint64_t>(buf_, 24, meta.hash);
  Put<uint64_t>(buf_, 32, meta.parent);
  Put<uint32_t>(buf_, 40, options_.block_size);
  Put<uint64_t>(buf_, 48, static_cast<uint64_t>(options_.block_bytes));
  std::memcpy(buf_ + kFixedHeader, meta.tokens.data(), 4 * meta.tokens.size());
  std::memcpy(buf_ + header_bytes_, bytes.data(), bytes.size());
  Put<uint64_t>(buf_, kChecksumOffset, Checksum(buf_, header_bytes_, options_.block_bytes));

  const std::string path = FilePath(meta.hash);
  const std::string tmp = path + ".tmp";
  {
    Fd fd(OpenFile(tmp, O_WRONLY | O_CREAT | O_TRUNC));
    if (fd.get() < 0) {
      return UnavailableError(fmt::format("disk KV tier: cannot create {}: {}", tmp, std::strerror(errno)));
    }
    size_t done = 0;
    while (done < file_bytes_) {
      const ssize_t n = ::pwrite(fd.get(), buf_ + done, file_bytes_ - done, static_cast<off_t>(done));
      if (n <= 0) {
        const int err = errno;
        ::unlink(tmp.c_str());
        return UnavailableError(fmt::format("disk KV tier: writing {}: {}", tmp, std::strerror(err)));
      }
      done += static_cast<size_t>(n);
    }
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return UnavailableError(fmt::format("disk KV tier: renaming {}: {}", tmp, std::strerror(err)));
  }
  Entry e;
  e.parent = meta.parent;
  e.tokens = meta.tokens;
  e.lru = lru_.insert(lru_.end(), meta.hash);
  index_.emplace(meta.hash, std::move(e));
  return Status::Ok();
}

Status DiskKvTier::Read(uint64_t hash, std::span<const uint32_t> tokens, std::span<std::byte> out) {
  auto it = index_.find(hash);
  if (it == index_.end()) return NotFoundError(fmt::format("disk KV tier: no block {:016x}", hash));
  if (out.size() != options_.block_bytes) return InvalidArgumentError("disk KV tier: read of the wrong size");
  const std::string path = FilePath(hash);
  auto fail = [&](const std::string& why) {
    lru_.erase(it->second.lru);
    index_.erase(it);
    Discard(path, why);
    return DataLossError(fmt::format("disk KV tier: {}: {}", path, why));
  };
  Fd fd(OpenFile(path, O_RDONLY));
  if (fd.get() < 0) return fail(fmt::format("cannot open: {}", std::strerror(errno)));
  size_t done = 0;
  while (done < file_bytes_) {
    const ssize_t n = ::pread(fd.get(), buf_ + done, file_bytes_ - done, static_cast<off_t>(done));
    if (n < 0) return fail(fmt::format("read error: {}", std::strerror(errno)));
    if (n == 0) return fail(fmt::format("truncated: {} of {} bytes", done, file_bytes_));
    done += static_cast<size_t>(n);
  }
  TierBlockMeta meta;
  if (Status s = CheckHeader({buf_, header_bytes_}, hash, &meta); !s.ok()) {
    return fail(std::string(s.message()));
  }
  if (Get<uint64_t>(buf_, kChecksumOffset) != Checksum(buf_, header_bytes_, options_.block_bytes)) {
    return fail("checksum mismatch (torn or corrupted)");
  }
  if (!std::equal(meta.tokens.begin(), meta.tokens.end(), tokens.begin(), tokens.end())) {
    return fail("token ids differ from the request's");
  }
  std::memcpy(out.data(), buf_ + header_bytes_, out.size());
  lru_.splice(lru_.end(), lru_, it->second.lru);
  return Status::Ok();
}

std::optional<uint64_t> DiskKvTier::LeastRecent() const {
  if (lru_.empty()) return std::nullopt;
  return lru_.front();
}

void DiskKvTier::Erase(uint64_t hash) {
  auto it = index_.find(hash);
  if (it == index_.end()) return;
  lru_.erase(it->second.lru);
  index_.erase(it);
  ::unlink(FilePath(hash).c_str());
}

void DiskKvTier::Clear() {
  for (const auto& [hash, e] : index_) ::unlink(FilePath(hash).c_str());
  index_.clear();
  lru_.clear();
}

std::vector<std::pair<uint64_t, uint64_t>> DiskKvTier::Entries() const {
  std::vector<std::pair<uint64_t, uint64_t>> out;
  out.reserve(index_.size());
  for (uint64_t h : lru_) out.emplace_back(h, index_.at(h).parent);
  return out;
}

}  // namespace tandem::engine
