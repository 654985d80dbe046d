// Named accelerator profiles for the simulated-GPU backend and `tandem plan`.
// Numbers are the vendors' published datasheet figures (dense bf16 tensor
// FLOP/s, i.e. without 2:4 sparsity; HBM/GDDR bandwidth; device memory);
// each profile names its source.
//
// Thread-safety: the table is immutable; any thread.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace tandem::sim {

struct HardwareProfile {
  std::string name;              // "H100"
  std::string description;       // "NVIDIA H100 SXM5 80GB"
  double peak_flops = 0;         // dense bf16 FLOP/s
  double memory_bytes_per_s = 0; // device memory bandwidth
  double memory_bytes = 0;       // device memory capacity
  std::string source;            // where the numbers come from
};

// The built-in profiles (H100, H200, A100, L40S).
const std::vector<HardwareProfile>& HardwareProfiles();

// Case-insensitive lookup; NOT_FOUND naming the known profiles otherwise.
Result<HardwareProfile> FindHardwareProfile(std::string_view name);

// "H100, H200, A100, L40S"
std::string HardwareProfileNames();

}  // namespace tandem::sim
