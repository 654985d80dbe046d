// A Watch batch read without protobuf's messages (issue 23): the
// WorkerUpdate a worker sends a batched watcher each round of its watch
// loop (`kind` unset: KV events in id order, then the round's load report)
// is the frame loop's most frequent frame, a few per 8k prompt. Parsed
// into a WorkerUpdate on an arena it cost ~5 % of the proxy's CPU per
// prompt (each event's submessage, its hash array copied into a
// RepeatedField, the arena's resets); here the events become the router's
// KvEventViews directly, their hashes copied once into a reused vector.
//
// Only the batch's usual shape is taken: stored, removed or cleared events
// with fixed64 hashes (WatchRequest.fixed64_hashes), an optional
// batched_load, the epoch. Anything else (a snapshot, a single event or
// load, watch_ended, varint hashes, a field protobuf would merge, an
// unknown or malformed field) is left to protobuf (WorkerUpdateParser), so
// what the router is told stays what protobuf would read.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "router/types.h"
#include "tandem/v1/worker.pb.h"

namespace tandem::proxy {

struct WatchBatch {
  uint64_t epoch = 0;                       // WorkerUpdate.epoch
  std::vector<router::KvEventView> events;  // their hashes point into `hashes`
  bool has_load = false;
  v1::LoadReport load;           // batched_load, when has_load
  std::vector<uint64_t> hashes;  // every event's hashes, in order (storage, reused)
};

// True when `payload` is a batch of that shape: `out` holds it until the
// next call. False: parse the payload with protobuf (`out` is unspecified).
bool ParseWatchBatch(std::string_view payload, WatchBatch& out);

// The router's view of a worker's KV event parsed by protobuf (the hashes
// read in place, from whichever field carries them: common/wire_ids.h);
// valid while `e` is. What ParseWatchBatch's events must equal.
router::KvEventView KvEventViewFromProto(const tandem::v1::KvEvent& e);

}  // namespace tandem::proxy
