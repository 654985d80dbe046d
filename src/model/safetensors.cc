#include "model/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "model/json_util.h"

namespace tandem::model {
namespace {

// A header larger than this is not a model header (the format's own limit is
// 100 MB); refusing it avoids huge allocations on a corrupt length.
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

uint64_t DtypeBytes(SafetensorsDtype d) { return d == SafetensorsDtype::kF32 ? 4 : 2; }

}  // namespace

uint64_t SafetensorsTensor::numel() const {
  uint64_t n = 1;
  for (uint64_t d : shape) n *= d;
  return n;
}

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);  // inf / nan
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;  // signed zero
  } else {
    // Subnormal half: normalise into a float exponent.
    int e = -1;
    do {
      ++e;
      mant <<= 1;
    } while ((mant & 0x400u) == 0);
    bits = sign | (static_cast<uint32_t>(112 - e) << 23) | ((mant & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

float Bfloat16ToFloat(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

uint16_t FloatToBfloat16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    return static_cast<uint16_t>((u >> 16) | 0x0040u);  // NaN: sign kept, quiet
  }
  // Round to nearest, ties to even: add half an ulp of the kept part, minus
  // one when the kept part is even. A carry into the exponent is the right
  // result (the next binade, or infinity past the largest finite value).
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

std::string ShapeToString(std::span<const uint64_t> shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

SafetensorsFile::~SafetensorsFile() {
  if (map_ != nullptr) munmap(const_cast<uint8_t*>(map_), file_size_bytes_);
}

const SafetensorsTensor* SafetensorsFile::Find(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

Result<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  std::unique_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->path_ = path;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return NotFoundError(path + ": cannot open: " + std::strerror(errno));
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return DataLossError(path + ": cannot stat: " + std::strerror(err));
  }
  f->file_size_bytes_ = static_cast<uint64_t>(st.st_size);
  if (f->file_size_bytes_ < 8) {
    ::close(fd);
    return DataLossError(path + ": truncated: " + std::to_string(f->file_size_bytes_) +
                         " bytes, shorter than the 8-byte header length");
  }
  void* m = mmap(nullptr, f->file_size_bytes_, PROT_READ, MAP_PRIVATE, fd, 0);
  const int err = errno;
  ::close(fd);
  if (m == MAP_FAILED) return InternalError(path + ": mmap failed: " + std::strerror(err));
  f->map_ = static_cast<const uint8_t*>(m);

  uint64_t header_bytes = 0;
  for (int i = 7; i >= 0; --i) header_bytes = (header_bytes << 8) | f->map_[i];
  if (header_bytes > f->file_size_bytes_ - 8) {
    return DataLossError(path + ": header length " + std::to_string(header_bytes) +
                         " bytes runs past the end of the file (" +
                         std::to_string(f->file_size_bytes_) + " bytes): truncated or corrupt");
  }
  if (header_bytes > kMaxHeaderBytes) {
    return DataLossError(path + ": header length " + std::to_string(header_bytes) +
                         " bytes exceeds the limit of " + std::to_string(kMaxHeaderBytes));
  }
  f->data_offset_bytes_ = 8 + header_bytes;
  const uint64_t data_bytes = f->file_size_bytes_ - f->data_offset_bytes_;

  auto header = internal::ParseJson(
      std::string_view(reinterpret_cast<const char*>(f->map_) + 8, header_bytes),
      path + ": header");
  if (!header.ok()) return header.status();
  if (!header->is_object()) return DataLossError(path + ": header is not a JSON object");

  for (const auto& [name, info] : header->items()) {
    if (name == "__metadata__") continue;
    const std::string where = path + ": tensor '" + name + "'";
    if (!info.is_object()) return DataLossError(where + ": entry is not an object");
    SafetensorsTensor t;
    auto dtype = info.find("dtype");
    if (dtype == info.end() || !dtype->is_string()) return DataLossError(where + ": no dtype");
    const std::string d = dtype->get<std::string>();
    if (d == "F32") {
      t.dtype = SafetensorsDtype::kF32;
    } else if (d == "F16") {
      t.dtype = SafetensorsDtype::kF16;
    } else if (d == "BF16") {
      t.dtype = SafetensorsDtype::kBF16;
    } else {
      return UnimplementedError(where + ": dtype " + d + " is not supported (F32, F16, BF16)");
    }
    auto shape = info.find("shape");
    if (shape == info.end() || !shape->is_array()) return DataLossError(where + ": no shape");
    uint64_t numel = 1;
    for (const auto& dim : *shape) {
      if (!dim.is_number_unsigned()) return DataLossError(where + ": bad shape " + shape->dump());
      const uint64_t v = dim.get<uint64_t>();
      if (v != 0 && numel > UINT64_MAX / 8 / v) {
        return DataLossError(where + ": shape " + shape->dump() + " overflows");
      }
      numel *= v;
      t.shape.push_back(v);
    }
    auto offsets = info.find("data_offsets");
    if (offsets == info.end() || !offsets->is_array() || offsets->size() != 2 ||
        !(*offsets)[0].is_number_unsigned() || !(*offsets)[1].is_number_unsigned()) {
      return DataLossError(where + ": data_offsets must be two non-negative integers");
    }
    t.begin_bytes = (*offsets)[0].get<uint64_t>();
    t.end_bytes = (*offsets)[1].get<uint64_t>();
    if (t.begin_bytes > t.end_bytes) {
      return DataLossError(where + ": data_offsets [" + std::to_string(t.begin_bytes) + ", " +
                           std::to_string(t.end_bytes) + ") are reversed");
    }
    if (t.end_bytes > data_bytes) {
      return DataLossError(where + ": data_offsets [" + std::to_string(t.begin_bytes) + ", " +
                           std::to_string(t.end_bytes) + ") run past the end of the data (" +
                           std::to_string(data_bytes) + " bytes): truncated or corrupt file");
    }
    const uint64_t want = numel * DtypeBytes(t.dtype);
    if (t.end_bytes - t.begin_bytes != want) {
      return DataLossError(where + ": data_offsets span " +
                           std::to_string(t.end_bytes - t.begin_bytes) + " bytes but " + d +
                           " shape " + ShapeToString(t.shape) + " needs " + std::to_string(want));
    }
    f->tensors_.emplace(name, std::move(t));
  }

  // No two tensors may share bytes.
  std::vector<std::pair<const std::string*, const SafetensorsTensor*>> order;
  for (const auto& [name, t] : f->tensors_) order.emplace_back(&name, &t);
  std::sort(order.begin(), order.end(), [](const auto& a, const auto& b) {
    return a.second->begin_bytes < b.second->begin_bytes;
  });
  for (size_t i = 1; i < order.size(); ++i) {
    const auto& prev = order[i - 1];
    const auto& cur = order[i];
    if (cur.second->begin_bytes < prev.second->end_bytes &&
        cur.second->end_bytes > cur.second->begin_bytes &&
        prev.second->end_bytes > prev.second->begin_bytes) {
      return DataLossError(path + ": tensor '" + *cur.first + "' data_offsets [" +
                           std::to_string(cur.second->begin_bytes) + ", " +
                           std::to_string(cur.second->end_bytes) + ") overlap tensor '" +
                           *prev.first + "' [" + std::to_string(prev.second->begin_bytes) + ", " +
                           std::to_string(prev.second->end_bytes) + ")");
    }
  }
  return f;
}

namespace {

// Takes the whole pages of [p, p + n) out of this process's resident
// memory once a tensor has been copied out of the mapping (they stay in the
// page cache; a second read faults them back in with the same bytes). A
// load then holds the converted tensors, not them plus the file.
void DropPages(const uint8_t* p, uint64_t n) {
  static const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(p) + page - 1) & ~(page - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + n) & ~(page - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
}

}  // namespace

Result<const SafetensorsTensor*> SafetensorsFile::Check(
    const std::string& name, std::span<const uint64_t> expected_shape) const {
  const SafetensorsTensor* t = Find(name);
  if (t == nullptr) return NotFoundError(path_ + ": missing tensor '" + name + "'");
  if (!std::equal(t->shape.begin(), t->shape.end(), expected_shape.begin(),
                  expected_shape.end())) {
    return InvalidArgumentError(path_ + ": tensor '" + name + "' has shape " +
                                ShapeToString(t->shape) + ", the config needs " +
                                ShapeToString(expected_shape));
  }
  return t;
}

Result<std::vector<uint16_t>> SafetensorsFile::ReadBf16(
    const std::string& name, std::span<const uint64_t> expected_shape) const {
  TANDEM_ASSIGN_OR_RETURN(const SafetensorsTensor* t, Check(name, expected_shape));
  const uint64_t n = t->numel();
  std::vector<uint16_t> out(n);
  const uint8_t* src = map_ + data_offset_bytes_ + t->begin_bytes;  // [n * dtype bytes]
  switch (t->dtype) {
    case SafetensorsDtype::kF32:
      for (uint64_t i = 0; i < n; ++i) {
        float f;
        std::memcpy(&f, src + 4 * i, 4);
        out[i] = FloatToBfloat16(f);
      }
      break;
    case SafetensorsDtype::kF16:
      for (uint64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        out[i] = FloatToBfloat16(HalfToFloat(h));  // exact to f32, then one rounding
      }
      break;
    case SafetensorsDtype::kBF16:
      std::memcpy(out.data(), src, n * 2);
      break;
  }
  DropPages(src, t->end_bytes - t->begin_bytes);
  return out;
}

Result<std::vector<float>> SafetensorsFile::ReadF32(
    const std::string& name, std::span<const uint64_t> expected_shape) const {
  TANDEM_ASSIGN_OR_RETURN(const SafetensorsTensor* t, Check(name, expected_shape));
  const uint64_t n = t->numel();
  std::vector<float> out(n);
  const uint8_t* src = map_ + data_offset_bytes_ + t->begin_bytes;  // [n * dtype bytes]
  switch (t->dtype) {
    case SafetensorsDtype::kF32:
      std::memcpy(out.data(), src, n * 4);
      break;
    case SafetensorsDtype::kF16:
      for (uint64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        out[i] = HalfToFloat(h);
      }
      break;
    case SafetensorsDtype::kBF16:
      for (uint64_t i = 0; i < n; ++i) {
        uint16_t b;
        std::memcpy(&b, src + 2 * i, 2);
        out[i] = Bfloat16ToFloat(b);
      }
      break;
  }
  DropPages(src, t->end_bytes - t->begin_bytes);
  return out;
}

}  // namespace tandem::model
