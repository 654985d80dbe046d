// Internal: the instruction set the kernels dispatch on.
#pragma once

#include "kernels/cpu/ops.h"

namespace tandem::kernels::cpu::internal {
Isa CurrentIsa();
}  // namespace tandem::kernels::cpu::internal
