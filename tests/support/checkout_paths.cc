// The one object compiled with the checkout's paths (see checkout_paths.h).
#include "checkout_paths.h"

namespace tandem::checkout {

const char* SourceDir() { return TANDEM_CHECKOUT_SOURCE_DIR; }
const char* BinaryDir() { return TANDEM_CHECKOUT_BINARY_DIR; }

}  // namespace tandem::checkout
