// Device discovery for the CUDA backend. Without a GPU (or driver) the CUDA
// runtime returns an error from cudaGetDeviceCount: that means "no device",
// never a crash.
#pragma once

namespace tandem::kernels::cuda {

// Number of usable CUDA devices; 0 when there is no driver or no device.
// `error` (optional, size >= 256) receives the runtime's reason when 0.
int DeviceCount(char* error = nullptr, int error_size = 0);

// The compute capabilities this library was compiled for, e.g. "90".
const char* CompiledArchitectures();

}  // namespace tandem::kernels::cuda
