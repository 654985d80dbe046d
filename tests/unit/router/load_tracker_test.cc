// LoadTracker::Complete (router/load_tracker.h): a stored KV event ends the
// oldest open prefill whose key (its prompt's last full block) is among
// the event's hashes. Checked against a plain model (the scan of every
// open prefill's key through the event that Complete did before issue 23
// session 36) over random prefills, ends and events: keys shared by
// several prefills, events holding several keys (one prompt the prefix of
// another), keys that collide in Complete's bit filter, and up to
// thousands of open prefills (filters of several sizes).
#include "router/load_tracker.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <deque>
#include <random>
#include <vector>

namespace tandem::router {
namespace {

// What Complete must do, the plain way.
struct Model {
  struct P {
    uint64_t ticket, key;
    int64_t tokens;
    bool open = true;
  };
  std::deque<P> prefills;
  int64_t open_tokens = 0;

  void Add(uint64_t ticket, uint64_t key, int64_t tokens) {
    prefills.push_back({ticket, key, tokens});
    open_tokens += tokens;
  }
  bool End(uint64_t ticket) {
    for (P& p : prefills) {
      if (p.ticket == ticket && p.open) {
        p.open = false;
        open_tokens -= p.tokens;
        return true;
      }
    }
    return false;
  }
  uint32_t Complete(const std::vector<uint64_t>& hashes) {
    for (P& p : prefills) {
      if (!p.open || p.key == 0) continue;
      if (std::find(hashes.begin(), hashes.end(), p.key) == hashes.end()) continue;
      p.open = false;
      open_tokens -= p.tokens;
      return 1;
    }
    return 0;
  }
  uint32_t keyed() const {
    uint32_t n = 0;
    for (const P& p : prefills) n += p.open && p.key != 0;
    return n;
  }
};

// Runs `ops` random operations with up to `max_open` prefills open at once.
void CheckAgainstModel(uint32_t max_open, uint32_t ops, uint32_t seed) {
  constexpr WorkerId kW = 3;
  LoadTracker t(/*report_lag_ns=*/5'000'000, /*max_prediction_age_ns=*/INT64_MAX / 4);
  t.Reset(kW, 1000);
  Model m;
  std::mt19937_64 rng(seed);
  // Keys: a small pool (so several prefills share one), each with the same
  // low 16 bits as others (so they share a bit in every filter size used
  // here), and sometimes none (0).
  std::vector<uint64_t> pool;
  for (uint32_t i = 0; i < std::max<uint32_t>(8, max_open / 2); ++i) {
    pool.push_back((rng() & ~uint64_t{0xffff}) | (i % 4 == 0 ? 0x1234 : rng() & 0xffff));
  }
  uint64_t ticket = 0;
  std::vector<uint64_t> open_tickets;
  // The first max_open operations only add, so the queue is deep at once.
  for (uint32_t n = 0; n < max_open + ops; ++n) {
    const uint32_t op = n < max_open ? 0 : rng() % 8;
    if (op < 3 && m.keyed() < max_open) {
      const uint64_t key = rng() % 16 == 0 ? 0 : pool[rng() % pool.size()];
      const int64_t tokens = static_cast<int64_t>(1 + rng() % 100'000);
      PrefillWork w;
      w.ticket = ++ticket;
      w.key = key;
      w.tokens = tokens;
      t.AddPrefill(kW, w, /*now_ns=*/static_cast<int64_t>(n));
      m.Add(w.ticket, key, tokens);
      open_tickets.push_back(w.ticket);
    } else if (op == 3 && !open_tickets.empty()) {
      const size_t i = rng() % open_tickets.size();
      const uint64_t tk = open_tickets[i];
      open_tickets.erase(open_tickets.begin() + static_cast<ptrdiff_t>(i));
      ASSERT_EQ(t.End(kW, tk), m.End(tk)) << "end " << tk << " at op " << n;
    } else {
      // A stored event: random hashes, with 0-3 keys of the pool (open or
      // not) at random places, and now and then a hash that shares a key's
      // low 16 bits without being it (a filter hit that is no key).
      std::vector<uint64_t> hashes(1 + rng() % 200);
      for (uint64_t& h : hashes) h = rng();
      for (uint32_t k = rng() % 4; k > 0; --k)
        hashes[rng() % hashes.size()] = pool[rng() % pool.size()];
      if (rng() % 4 == 0) hashes[rng() % hashes.size()] = (rng() & ~uint64_t{0xffff}) | 0x1234;
      ASSERT_EQ(t.Complete(kW, hashes), m.Complete(hashes)) << "event at op " << n;
    }
    ASSERT_EQ(t.load(kW).queued_prefill_tokens, m.open_tokens) << "op " << n;
    ASSERT_EQ(t.keyed_predictions(kW), m.keyed()) << "op " << n;
  }
}

TEST(LoadTrackerComplete, AFewOpenPrefillsMatchAModel) { CheckAgainstModel(16, 20'000, 1); }

TEST(LoadTrackerComplete, HundredsOpenMatchAModel) { CheckAgainstModel(300, 10'000, 2); }

TEST(LoadTrackerComplete, ThousandsOpenMatchAModel) { CheckAgainstModel(3000, 2'000, 3); }

// The prefix case by hand: prompt B is the first half of prompt A, both
// queued (B older); A's last chunk's event holds B's key too, so it ends B
// (the older), and the next event with A's key ends A.
TEST(LoadTrackerComplete, AnEventHoldingTwoKeysEndsTheOlderPrefill) {
  constexpr WorkerId kW = 0;
  LoadTracker t(5'000'000, INT64_MAX / 4);
  t.Reset(kW, 1000);
  const std::vector<uint64_t> chain = {11, 22, 33, 44};
  t.AddPrefill(kW, {.ticket = 1, .key = 22, .tokens = 32}, 0);  // B: blocks 11, 22
  t.AddPrefill(kW, {.ticket = 2, .key = 44, .tokens = 64}, 1);  // A: blocks 11..44
  EXPECT_EQ(t.Complete(kW, std::vector<uint64_t>{99, 98}), 0u);
  EXPECT_EQ(t.load(kW).queued_prefill_tokens, 96);
  EXPECT_EQ(t.Complete(kW, chain), 1u);
  EXPECT_EQ(t.load(kW).queued_prefill_tokens, 64);
  EXPECT_EQ(t.Complete(kW, chain), 1u);
  EXPECT_EQ(t.load(kW).queued_prefill_tokens, 0);
  EXPECT_EQ(t.keyed_predictions(kW), 0u);
  EXPECT_EQ(t.Complete(kW, chain), 0u);
}

}  // namespace
}  // namespace tandem::router
