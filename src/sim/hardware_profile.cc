#include "sim/hardware_profile.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>

namespace tandem::sim {

const std::vector<HardwareProfile>& HardwareProfiles() {
  // Decimal units as the datasheets give them (1 TB/s = 1e12 B/s, 1 GB = 1e9 B).
  static const std::vector<HardwareProfile> kProfiles = {
      {"H100", "NVIDIA H100 SXM5 80GB", 989e12, 3.35e12, 80e9,
       "NVIDIA H100 Tensor Core GPU datasheet: BF16 1,979 TFLOPS with sparsity (989 dense), "
       "HBM3 3.35 TB/s, 80 GB (SXM5)"},
      {"H200", "NVIDIA H200 SXM 141GB", 989e12, 4.8e12, 141e9,
       "NVIDIA H200 Tensor Core GPU datasheet: BF16 1,979 TFLOPS with sparsity (989 dense), "
       "HBM3e 4.8 TB/s, 141 GB (SXM)"},
      {"A100", "NVIDIA A100 SXM4 80GB", 312e12, 2.039e12, 80e9,
       "NVIDIA A100 Tensor Core GPU datasheet: BF16 312 TFLOPS dense (624 with sparsity), "
       "HBM2e 2,039 GB/s, 80 GB (SXM)"},
      {"L40S", "NVIDIA L40S 48GB", 362.05e12, 864e9, 48e9,
       "NVIDIA L40S datasheet: BF16 362.05 TFLOPS dense (733 with sparsity), GDDR6 864 GB/s, "
       "48 GB"},
  };
  return kProfiles;
}

namespace {
std::string Upper(std::string_view s) {
  std::string out(s);
  std::transform(out.begin(), out.end(), out.begin(),
                 [](unsigned char c) { return static_cast<char>(std::toupper(c)); });
  return out;
}
}  // namespace

std::string HardwareProfileNames() {
  std::string out;
  for (const auto& p : HardwareProfiles()) out += (out.empty() ? "" : ", ") + p.name;
  return out;
}

Result<HardwareProfile> FindHardwareProfile(std::string_view name) {
  const std::string want = Upper(name);
  for (const auto& p : HardwareProfiles()) {
    if (Upper(p.name) == want) return p;
  }
  return NotFoundError(
      fmt::format("unknown hardware profile '{}' (known: {})", name, HardwareProfileNames()));
}

}  // namespace tandem::sim
