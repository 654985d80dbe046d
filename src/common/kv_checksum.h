// The end-to-end checksum of a KV block (transport.checksum,
// docs/failure-handling.md "KV checksums"; the host tier's spill check): the
// XXH3-64 of its bytes, seed 0. The prefiller's sums, the decoder's check and
// the host tier call this and nothing else, so a prefiller and a decoder
// always agree. (The disk tier's file checksum, over its header and payload,
// is streamed through the library's XXH3 state; its cost is the file's I/O.)
//
// Where libxxhash exports its x86 dispatcher (Debian's 0.8.1 does), the sum is
// computed by the widest vector path this CPU runs (AVX-512, AVX2 or SSE2,
// chosen once at the first call); XXH3's value does not depend on the path
// (its specification), so hosts with different CPUs check each other's sums.
// Elsewhere it is the library's XXH3_64bits. Measured:
// bench/results/kv_checksum.md.
#pragma once

#include <cstddef>
#include <cstdint>

namespace tandem {

uint64_t KvChecksum(const void* data, size_t bytes);

// "xxh3-dispatch" or "xxh3": which of the two the build calls (for the
// benchmark's and the test's labels).
const char* KvChecksumImplementation();

}  // namespace tandem
