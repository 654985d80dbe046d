#pragma once

#include <string_view>

namespace tandem {

std::string_view Version();      // e.g. "0.1.0"
std::string_view GitRevision();  // short hash at configure time, or "unknown"
bool CudaKernelsCompiled();

}  // namespace tandem
