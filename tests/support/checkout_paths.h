// Where the checkout and its build are, for tests and benchmarks that run
// the tandem binary or read the repository's files (models, configs,
// fixtures).
//
// Every test and benchmark object gets this header through the compiler's
// -include (CMake target tandem_checkout_paths), so TANDEM_SOURCE_DIR and
// TANDEM_BINARY_DIR read as before: a C string, e.g.
// `std::string(TANDEM_BINARY_DIR) + "/tandem"`. They are not string
// literals (no literal concatenation): the two paths are compiled into one
// object only, checkout_paths.cc, so that every other object is the same in
// any checkout and ccache reuses it across worktrees and clones.
#pragma once

namespace tandem::checkout {

const char* SourceDir();  // the repository root, e.g. /work/main
const char* BinaryDir();  // the CMake build directory, which holds `tandem`

}  // namespace tandem::checkout

#define TANDEM_SOURCE_DIR (::tandem::checkout::SourceDir())
#define TANDEM_BINARY_DIR (::tandem::checkout::BinaryDir())
