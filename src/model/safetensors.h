// One safetensors file, memory-mapped and validated when opened: the 8-byte
// little-endian header length, the JSON header, and every tensor's dtype,
// shape and data offsets (inside the file, in order, not overlapping, sized
// exactly numel * dtype bytes). Reads convert f32 / f16 / bf16 to f32 or
// to bf16.
//
// Thread-safety: immutable after Open; reads may run on any thread.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"

namespace tandem::model {

enum class SafetensorsDtype { kF32, kF16, kBF16 };

struct SafetensorsTensor {
  SafetensorsDtype dtype = SafetensorsDtype::kF32;
  std::vector<uint64_t> shape;
  uint64_t begin_bytes = 0;  // offset of the data from the start of the data section
  uint64_t end_bytes = 0;    // one past the end
  uint64_t numel() const;
};

class SafetensorsFile {
 public:
  // Maps `path` and validates its header; every malformed file is an error
  // naming the file (and the tensor, where one is at fault).
  static Result<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::map<std::string, SafetensorsTensor>& tensors() const { return tensors_; }
  const SafetensorsTensor* Find(const std::string& name) const;

  // The tensor converted to f32 ([numel], row-major). `expected_shape` must
  // equal the stored shape; a mismatch or an absent tensor is an error naming
  // the file and the tensor.
  Result<std::vector<float>> ReadF32(const std::string& name,
                                     std::span<const uint64_t> expected_shape) const;
  // The same, converted to bfloat16 bits (FloatToBfloat16 of the stored
  // value: bf16 is copied, f32 and f16 are rounded to nearest even once).
  Result<std::vector<uint16_t>> ReadBf16(const std::string& name,
                                         std::span<const uint64_t> expected_shape) const;

 private:
  SafetensorsFile() = default;
  Result<const SafetensorsTensor*> Check(const std::string& name,
                                         std::span<const uint64_t> expected_shape) const;
  std::string path_;
  const uint8_t* map_ = nullptr;  // [file_size_bytes_]
  uint64_t file_size_bytes_ = 0;
  uint64_t data_offset_bytes_ = 0;  // 8 + header length
  std::map<std::string, SafetensorsTensor> tensors_;
};

// IEEE half and bfloat16 to float (exact).
float HalfToFloat(uint16_t h);
float Bfloat16ToFloat(uint16_t b);
// float to bfloat16, round to nearest, ties to even (as __float2bfloat16_rn):
// overflow gives infinity, NaN stays NaN (quiet, sign kept).
uint16_t FloatToBfloat16(float f);

std::string ShapeToString(std::span<const uint64_t> shape);

}  // namespace tandem::model
