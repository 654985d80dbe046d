// One request's state inside the engine.
//
// Thread-safety: none; touched under the engine lock, or by the engine
// thread alone while the sequence is in flight (see Engine).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine/request.h"
#include "model/stop_strings.h"
#include "model/tokenizer.h"

namespace tandem::engine {

struct FairTenant;  // engine/fair_share.h

enum class SeqState { kWaiting, kRunning, kParked, kFinished };

struct Sequence {
  GenerateRequest req;  // its on_output moved to `on_output`
  // The output callback, shared with the step's deliveries so that queuing
  // one copies a pointer, not the callback (issue 23).
  std::shared_ptr<const OutputCallback> on_output;
  uint64_t seed = 0;
  std::vector<uint32_t> tokens;  // prompt + output tokens
  uint32_t prompt_len = 0;
  uint32_t num_computed = 0;      // leading tokens whose KV is in `blocks`
  std::vector<uint32_t> blocks;   // block table
  uint64_t root_hash = 0;         // chain root: the engine's context + req.cache_salt
  std::vector<uint64_t> hashes;   // chained hashes of the full blocks of `tokens` (a prefix)
  uint32_t num_committed = 0;     // leading blocks registered in (or taken from) the prefix cache
  bool commit_stopped = false;    // its later blocks stay private (Engine::CommitFullBlocks)
  uint32_t cached_prompt_tokens = 0;
  // Blocks onboarded from the host / disk tier at admission, not yet
  // reported to the backend (the sim backend models their copy time).
  uint32_t onboard_host_blocks = 0;
  uint32_t onboard_disk_blocks = 0;
  bool admitted_once = false;
  uint32_t num_preemptions = 0;   // KvProgress::attempt
  uint64_t arrival = 0;           // the scheduler's arrival number (0 = not yet queued)
  FairTenant* fair_tenant = nullptr;  // its tenant in the scheduler's FairShare, once queued
  std::chrono::steady_clock::time_point queued_since{};  // set with `arrival`
  bool queue_time_reported = false;
  SeqState state = SeqState::kWaiting;
  bool in_flight = false;         // part of the step being computed
  bool abort_requested = false;   // Abort() while in flight
  uint32_t num_delivered = 0;     // output tokens delivered to the callback
  std::string pending_text;       // decoded text not yet delivered
  bool stop_string_hit = false;
  std::unique_ptr<model::IncrementalDetokenizer> detok;  // with a tokenizer
  std::unique_ptr<model::StopStringMatcher> stop_matcher;

  uint32_t num_output() const { return static_cast<uint32_t>(tokens.size()) - prompt_len; }
  uint32_t num_pending() const { return static_cast<uint32_t>(tokens.size()) - num_computed; }
};

}  // namespace tandem::engine
