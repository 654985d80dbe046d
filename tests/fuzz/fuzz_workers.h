// The workers behind the server targets' Frontend (server_fuzz.h): two
// prefillers and two decoders in its fleet, answered in this process by a
// scripted WorkerClient, so that a request that passes the front end's
// checks runs the rest of its lifecycle — routing, the decode start and
// the Prefill, the first token, the streamed tokens, stop tokens, retries,
// migrations, the workers' errors, cancellation by a client that goes away
// — while the client's bytes are whatever the fuzzer made of them.
//
// What a request meets is chosen from its prompt (its length, first and
// last ids and the attempt: fuzz_worker_script.h), so the fuzzer steers it:
// a completion of up to kMaxTokens tokens, a refused or failing Prefill, a
// decoder that breaks
// (the proxy migrates) or refuses in band, a decoder that stalls after a
// few tokens or a Prefill that never answers (until the proxy cancels the
// call or its deadline passes, as a hung worker would). Delivery follows
// the real transports' threading: a prefill's reply and every decode event
// come from this object's own thread, one call at a time; a decode's Cancel
// ends it at once on the caller's thread (as DecodeMux::CancelRequest), a
// Prefill's later on the worker thread (as PrefillTcpClient).
//
// live() counts the calls whose last event has not run and that were not
// forgotten: a call the lifecycle leaves behind after its request ended is
// a worker's registration and KV blocks left reserved, and the targets trap
// on it.
#pragma once

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "fuzz_worker_script.h"
#include "proxy/fleet.h"
#include "proxy/worker_client.h"

namespace tandem::fuzz {

class FuzzWorkers : public proxy::WorkerClient {
 public:
  static constexpr uint32_t kMaxTokens = 40;  // a longer completion ends at "the context"
  // Two of each, so that a retry or a migration finds another worker at
  // once (with one, the proxy gives the registry up to 1 s to drop the
  // failed one first: lifecycle.cc, Launch). The first decoder as this
  // version's (Prefill with the start, prompt by reference), the second as
  // an older version's.
  static constexpr const char* kPrefillers[2] = {"fuzz-prefill-a:1", "fuzz-prefill-b:1"};
  static constexpr const char* kDecoders[2] = {"fuzz-decode-a:1", "fuzz-decode-b:1"};

  explicit FuzzWorkers(uint32_t vocab_size) : vocab_(vocab_size) {
    thread_ = std::thread([this] { Loop(); });
    thread_.detach();  // never destroyed (the servers' threads outlive inputs)
  }

  // Registers the four workers in `fleet` (false: a worker was refused).
  static bool Register(proxy::Fleet& fleet, const std::string& model) {
    auto record = [&](const char* address, router::WorkerRole role, bool current) {
      proxy::WorkerRecord w;
      w.name = std::string(address).substr(0, std::string(address).find(':'));
      w.role = role;
      w.grpc_address = address;
      w.reserve_waits_for_registration = current;
      w.takes_prompt_from_reserve = current;
      w.protocol_version = 1;
      w.model = model;
      w.block_size = 16;
      w.kv_dtype = "f32";
      w.block_bytes = 4096;
      w.num_blocks = 4096;
      return fleet.Register(w).ok();
    };
    return record(kPrefillers[0], router::WorkerRole::kPrefill, true) &&
           record(kPrefillers[1], router::WorkerRole::kPrefill, true) &&
           record(kDecoders[0], router::WorkerRole::kDecode, true) &&
           record(kDecoders[1], router::WorkerRole::kDecode, false);
  }

  int live() const { return live_.load(); }
  // Waits until no call is live (the last one's end wakes it); false when
  // `patience` passed first.
  bool WaitIdle(std::chrono::milliseconds patience) {
    std::unique_lock lock(idle_mu_);
    return idle_cv_.wait_for(lock, patience, [this] { return live_.load() == 0; });
  }

  // What the inputs reached, for a run's record: calls by kind, tokens
  // sent, and calls by what they met (ScriptOf(), 0 to 11).
  std::string Summary() const {
    std::vector<uint64_t> by_script;
    for (const auto& n : by_script_) by_script.push_back(n.load());
    return fmt::format(
        "fuzz workers: {} decode calls, {} prefill calls, {} tokens sent; by script: {}",
        decodes_made_.load(), prefills_made_.load(), tokens_sent_.load(),
        fmt::join(by_script, " "));
  }

  std::shared_ptr<proxy::Call> Decode(const std::string&, proxy::DecodeArgs args,
                                      proxy::DecodeEvents events) override {
    auto c = std::make_shared<FakeCall>(this, Kind::kDecode);
    c->script = ScriptOf(*args.prompt_ids, args.attempt);
    c->key = args.request_id + "#" + std::to_string(args.attempt);
    c->params = args.params;
    c->deadline = args.deadline;
    c->fold_registered = args.registered_with_first_item;
    c->quiet = args.quiet_end_on_first_token;
    c->local = args.prefill_locally;
    c->events = std::move(events);
    live_.fetch_add(1);
    decodes_made_.fetch_add(1);
    by_script_[c->script].fetch_add(1);
    std::lock_guard lock(mu_);
    if (c->script == kDecodeRefuses) {
      runnable_.push_back(c);  // its error, without `registered`
    } else if (!c->fold_registered || args.prefill_locally) {
      c->step = Step::kRegister;
      runnable_.push_back(c);
    } else {
      parked_.push_back(c);  // until its Prefill has pushed the KV
    }
    decodes_[c->key] = c;
    cv_.notify_one();
    return c;
  }

  std::shared_ptr<proxy::Call> Prefill(
      const std::string&, proxy::PrefillArgs args,
      std::function<void(Result<proxy::PrefillResult>)> done) override {
    auto c = std::make_shared<FakeCall>(this, Kind::kPrefill);
    c->script = ScriptOf(*args.prompt_ids, args.attempt);
    c->key = args.request_id + "#" + std::to_string(args.attempt);
    c->params = args.params;
    c->deadline = args.deadline;
    c->done = std::move(done);
    live_.fetch_add(1);
    prefills_made_.fetch_add(1);
    std::lock_guard lock(mu_);
    if (c->script == kPrefillHangs) {
      parked_.push_back(c);
    } else {
      runnable_.push_back(c);
    }
    cv_.notify_one();
    return c;
  }

 private:
  enum class Kind { kDecode, kPrefill };
  enum class Step { kWaitKv, kRegister, kTokens };
  struct FakeCall : proxy::Call {
    FakeCall(FuzzWorkers* w, Kind k) : owner(w), kind(k) {}
    FuzzWorkers* owner;
    Kind kind;
    int script = 0;  // ScriptOf()
    std::string key;
    proxy::EngineArgs params;
    std::chrono::system_clock::time_point deadline;
    bool fold_registered = false, quiet = false;
    bool local = false;  // prefill_locally: no Prefill to wait for
    proxy::DecodeEvents events;
    std::function<void(Result<proxy::PrefillResult>)> done;
    // Under `ev_mu` (events run one at a time; recursive: a Cancel from
    // inside one of its own events ends it there, as the real stream does).
    std::recursive_mutex ev_mu;
    std::atomic<bool> ended{false};  // written under ev_mu
    bool registered = false;
    Step step = Step::kWaitKv;
    uint32_t next = 0;  // the next completion index to send
    std::atomic<bool> cancelled{false};

    void Cancel() override {
      cancelled = true;
      if (kind == Kind::kDecode) {
        std::lock_guard l(ev_mu);
        if (!ended && events.on_error) {
          ended = true;
          events.on_error(CancelledError("cancelled by the proxy"), false);
          owner->Ended();
        }
        return;
      }
      owner->Wake(this);
    }
    void Forget() override {
      std::lock_guard l(ev_mu);
      if (ended) return;
      ended = true;
      owner->Ended();
    }
  };

  // A call's last event has run (or it was forgotten).
  void Ended() {
    if (live_.fetch_sub(1) == 1) {
      std::lock_guard lock(idle_mu_);  // a waiter is in wait_for or sees 0
      idle_cv_.notify_all();
    }
  }

  // The completion's token at index i of this attempt (ids 1..vocab-1, and
  // now and then the eos id 0).
  uint32_t Token(const FakeCall& c, uint32_t i) const {
    const uint64_t at = uint64_t{c.params.first_sample_index} + i;
    uint64_t h = (std::hash<std::string>{}(c.key.substr(0, c.key.rfind('#'))) ^ c.params.seed) +
                 at * 0x9E3779B97F4A7C15ull;
    h ^= h >> 31;
    if (h % 23 == 0) return 0;
    return 1 + static_cast<uint32_t>(h % (vocab_ - 1));
  }

  bool Stops(const FakeCall& c, uint32_t id) const {
    if (id == 0 && !c.params.ignore_eos) return true;
    return std::find(c.params.stop_token_ids.begin(), c.params.stop_token_ids.end(), id) !=
           c.params.stop_token_ids.end();
  }

  void Wake(FakeCall* c) {
    std::lock_guard lock(mu_);
    for (auto it = parked_.begin(); it != parked_.end(); ++it) {
      if (it->get() == c) {
        runnable_.push_back(*it);
        parked_.erase(it);
        break;
      }
    }
    cv_.notify_one();
  }

  // Ends `c` with its last event (under its ev_mu, not yet ended).
  void EndDecode(FakeCall& c, const Status& st, bool from_worker) {
    c.ended = true;
    if (c.events.on_error) c.events.on_error(st, from_worker);
    Ended();
  }

  // One step of `c` on the worker thread; true: run it again later.
  bool Run(const std::shared_ptr<FakeCall>& c) {
    std::lock_guard l(c->ev_mu);
    if (c->ended) return false;
    if (c->kind == Kind::kPrefill) {
      c->ended = true;
      Result<proxy::PrefillResult> r = CancelledError("Cancelled");
      if (c->cancelled) {
      } else if (std::chrono::system_clock::now() >= c->deadline) {
        r = DeadlineExceededError("the request's deadline passed on the prefiller");
      } else if (c->script == kPrefillUnavailable) {
        r = UnavailableError("fuzz prefiller: connection reset");
      } else if (c->script == kPrefillNoRoom) {
        r = ResourceExhaustedError("decoder has no room");
      } else {
        proxy::PrefillResult ok;
        ok.first_token_id = Token(*c, 0);
        r = ok;
      }
      // The KV is pushed: the decode waiting for it goes on, its first item
      // before the reply or after it, by the prompt.
      std::shared_ptr<FakeCall> d;
      if (r.ok()) {
        std::lock_guard lock(mu_);
        if (auto it = decodes_.find(c->key); it != decodes_.end()) d = it->second.lock();
        if (d && std::find(parked_.begin(), parked_.end(), d) != parked_.end()) {
          std::erase(parked_, d);
        } else {
          d = nullptr;  // registering, or ended
        }
      }
      const bool decode_first = d != nullptr && c->script % 2 == 1;
      bool again = decode_first && Run(d);
      c->done(std::move(r));
      Ended();
      if (d != nullptr && (again || !decode_first)) {
        std::lock_guard lock(mu_);
        runnable_.push_back(std::move(d));
        cv_.notify_one();
      }
      return false;
    }
    // A decode.
    if (std::chrono::system_clock::now() >= c->deadline) {
      EndDecode(*c, DeadlineExceededError("the request's deadline passed on the decoder"), true);
      return false;
    }
    if (c->script == kDecodeRefuses) {
      EndDecode(*c, InvalidArgumentError("fuzz decoder: the request is refused"), true);
      return false;
    }
    if (c->step == Step::kRegister) {
      c->registered = true;
      c->step = Step::kWaitKv;
      if (c->events.on_registered) c->events.on_registered();
      if (c->ended) return false;
      if (c->local) return true;  // on to its tokens
      std::lock_guard lock(mu_);
      parked_.push_back(c);  // until its Prefill has pushed the KV
      return false;
    }
    if (!c->registered) {
      c->registered = true;
      if (c->events.on_registered) c->events.on_registered();
      if (c->ended) return false;
    }
    const uint32_t limit = std::min(std::max<uint32_t>(c->params.max_tokens, 1), kMaxTokens);
    if (c->quiet && c->params.max_tokens == 1) {
      return false;  // sends nothing; the proxy forgets the call
    }
    if (c->script == kDecodeStalls && c->next >= 3) {
      std::lock_guard lock(mu_);
      parked_.push_back(c);  // until cancelled or its deadline
      return false;
    }
    if (c->script == kDecodeBreaks && c->next >= 2) {
      EndDecode(*c, UnavailableError("Socket closed"), false);
      return false;
    }
    if (c->script == kDecodeFails && c->next >= 1) {
      EndDecode(*c, InternalError("fuzz decoder: the engine failed"), true);
      return false;
    }
    // Up to 3 tokens per event, as a delivery batch carries them.
    std::vector<uint32_t> ids;
    bool stop = false;
    while (ids.size() < 3 && c->next + ids.size() < limit && !stop) {
      const uint32_t id = Token(*c, c->next + static_cast<uint32_t>(ids.size()));
      ids.push_back(id);
      stop = Stops(*c, id);
    }
    const uint32_t first = c->next;
    c->next += static_cast<uint32_t>(ids.size());
    tokens_sent_.fetch_add(ids.size());
    if (!ids.empty() && c->events.on_tokens) c->events.on_tokens(first, ids);
    if (c->ended) return false;
    if (stop || c->next >= limit) {
      c->ended = true;
      if (c->events.on_finished) {
        c->events.on_finished(stop ? proxy::Finish::kStop : proxy::Finish::kLength, c->next, 0, 0);
      }
      Ended();
      return false;
    }
    return true;
  }

  void Loop() {
    std::unique_lock lock(mu_);
    for (;;) {
      // The parked calls' deadlines, and the cancelled prefills.
      const auto now = std::chrono::system_clock::now();
      auto next_deadline = now + std::chrono::seconds(1);
      for (auto it = parked_.begin(); it != parked_.end();) {
        if ((*it)->deadline <= now || (*it)->cancelled || (*it)->ended) {
          runnable_.push_back(*it);
          it = parked_.erase(it);
        } else {
          next_deadline = std::min(next_deadline, (*it)->deadline);
          ++it;
        }
      }
      std::erase_if(decodes_, [](const auto& kv) { return kv.second.expired(); });
      if (runnable_.empty()) {
        cv_.wait_until(lock, next_deadline);
        continue;
      }
      std::shared_ptr<FakeCall> c = std::move(runnable_.front());
      runnable_.pop_front();
      lock.unlock();
      const bool again = Run(c);
      lock.lock();
      if (again) runnable_.push_back(std::move(c));
    }
  }

  const uint32_t vocab_;
  std::atomic<int> live_{0};
  std::mutex idle_mu_;  // WaitIdle's; taken by the last call's end to wake it
  std::condition_variable idle_cv_;
  std::atomic<uint64_t> decodes_made_{0}, prefills_made_{0}, tokens_sent_{0};
  std::array<std::atomic<uint64_t>, kWorkerScripts> by_script_{};
  std::thread thread_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<FakeCall>> runnable_;
  std::vector<std::shared_ptr<FakeCall>> parked_;  // waiting for KV, a cancel or a deadline
  std::map<std::string, std::weak_ptr<FakeCall>> decodes_;  // by request id and attempt
};

}  // namespace tandem::fuzz
