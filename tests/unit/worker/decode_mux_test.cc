// The framing of the multiplexed decode stream (issue 23): MuxBatcher's
// batches, read back per handle, give every request's events in order and
// nothing else; a step of N requests is one message of N items. And
// DeliveryScope, which decides when a batch leaves.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "common/delivery_scope.h"
#include "decoder/decode_mux_batch.h"

namespace tandem::decoder {
namespace {

namespace pb = ::tandem::v1;

// One request's events as the proxy sees them.
struct Seen {
  bool registered = false;
  std::vector<uint32_t> tokens;  // in completion order, checked contiguous
  int finished = 0;              // completion_tokens of the finish, 0: none
  std::string error;
  int items = 0;
  bool ended = false;
  bool out_of_order = false;  // anything after the end, or registered after tokens
};

// What DecodeMuxClient does with a batch, as plain data.
void Demux(const pb::DecodeStreamResponse& batch, std::map<uint64_t, Seen>& seen) {
  for (const auto& item : batch.items()) {
    Seen& s = seen[item.handle()];
    ++s.items;
    if (s.ended) s.out_of_order = true;
    if (item.registered()) {
      if (!s.tokens.empty() || s.registered) s.out_of_order = true;
      s.registered = true;
    }
    if (item.token_ids_size() > 0) {
      if (item.first_index() != s.tokens.size()) s.out_of_order = true;
      s.tokens.insert(s.tokens.end(), item.token_ids().begin(), item.token_ids().end());
    }
    if (item.has_finished()) {
      s.finished = static_cast<int>(item.finished().completion_tokens());
      s.ended = true;
    }
    if (item.has_error()) {
      s.error = item.error().message();
      s.ended = true;
    }
  }
}

pb::DecodeStreamResponse RoundTrip(MuxBatcher& b) {
  const std::string wire = b.Take().SerializeAsString();
  pb::DecodeStreamResponse parsed;
  EXPECT_TRUE(parsed.ParseFromString(wire));
  return parsed;
}

// The decoder's way (decode_mux.cc): TakeInto one message reused for every
// batch, whose previous items are cleared and reused.
pb::DecodeStreamResponse RoundTripInto(MuxBatcher& b, pb::DecodeStreamResponse& current) {
  b.TakeInto(&current);
  pb::DecodeStreamResponse parsed;
  EXPECT_TRUE(parsed.ParseFromString(current.SerializeAsString()));
  return parsed;
}

pb::DecodeFinished Fin(uint32_t completion) {
  pb::DecodeFinished f;
  f.set_finish_reason(pb::FINISH_REASON_LENGTH);
  f.set_completion_tokens(completion);
  return f;
}

TEST(MuxBatcher, OneStepOfManyRequestsIsOneMessageWithOneItemEach) {
  MuxBatcher b;
  constexpr uint64_t kRequests = 32;
  for (uint64_t h = 1; h <= kRequests; ++h) b.Tokens(h, 7, std::vector<uint32_t>{uint32_t(100 + h)});
  ASSERT_EQ(b.num_items(), kRequests);
  const pb::DecodeStreamResponse m = RoundTrip(b);
  EXPECT_TRUE(b.empty());
  ASSERT_EQ(m.items_size(), static_cast<int>(kRequests));
  for (int i = 0; i < m.items_size(); ++i) {
    EXPECT_EQ(m.items(i).handle(), static_cast<uint64_t>(i + 1));
    EXPECT_EQ(m.items(i).first_index(), 7u);
    ASSERT_EQ(m.items(i).token_ids_size(), 1);
    EXPECT_EQ(m.items(i).token_ids(0), static_cast<uint32_t>(101 + i));
    EXPECT_FALSE(m.items(i).registered());
    EXPECT_EQ(m.items(i).end_case(), pb::DecodeStreamItem::END_NOT_SET);
  }
}

TEST(MuxBatcher, OneRequestsEventsInOneBatchShareOneItemInOrder) {
  MuxBatcher b;
  b.Registered(5);
  b.Tokens(5, 0, std::vector<uint32_t>{1, 2});
  b.Tokens(9, 3, std::vector<uint32_t>{50});
  b.Tokens(5, 2, std::vector<uint32_t>{3});
  b.Finished(5, Fin(3));
  const pb::DecodeStreamResponse m = RoundTrip(b);
  ASSERT_EQ(m.items_size(), 2);
  const auto& a = m.items(0);
  EXPECT_EQ(a.handle(), 5u);
  EXPECT_TRUE(a.registered());
  EXPECT_EQ(a.first_index(), 0u);
  EXPECT_EQ(std::vector<uint32_t>(a.token_ids().begin(), a.token_ids().end()),
            (std::vector<uint32_t>{1, 2, 3}));
  ASSERT_TRUE(a.has_finished());
  EXPECT_EQ(a.finished().completion_tokens(), 3u);
  EXPECT_EQ(m.items(1).handle(), 9u);
}

TEST(MuxBatcher, TokensThatDoNotContinueAndEventsAfterAnEndGetTheirOwnItems) {
  MuxBatcher b;
  b.Tokens(1, 0, std::vector<uint32_t>{10});
  b.Tokens(1, 5, std::vector<uint32_t>{15});  // not a continuation of [0, 1)
  b.Error(2, UnavailableError("lease expired"));
  b.Error(1, DeadlineExceededError("deadline passed"));
  const pb::DecodeStreamResponse m = RoundTrip(b);
  ASSERT_EQ(m.items_size(), 3);
  EXPECT_EQ(m.items(0).first_index(), 0u);
  EXPECT_FALSE(m.items(0).has_error());
  EXPECT_EQ(m.items(1).first_index(), 5u);
  EXPECT_EQ(m.items(1).error().code(), static_cast<int>(StatusCode::kDeadlineExceeded));
  EXPECT_EQ(m.items(2).handle(), 2u);
  EXPECT_EQ(m.items(2).error().code(), static_cast<int>(StatusCode::kUnavailable));
  EXPECT_EQ(m.items(2).error().message(), "lease expired");
  EXPECT_EQ(m.items(2).token_ids_size(), 0);
}

// The open items are a HandleTable (common/handle_table.h): handle 0 (the
// stream refuses it with an error item) is never open, an item ended in one
// batch is not continued in the next, and a handle whose tokens did not
// continue its item continues its newest item.
TEST(MuxBatcher, HandleZeroAndItemsAcrossBatches) {
  MuxBatcher b;
  b.Error(0, InvalidArgumentError("decode stream handle 0 is reserved"));
  b.Tokens(0, 0, std::vector<uint32_t>{1});
  b.Tokens(3, 0, std::vector<uint32_t>{30});
  b.Tokens(3, 4, std::vector<uint32_t>{34});  // not a continuation: a new item
  b.Tokens(3, 5, std::vector<uint32_t>{35});  // continues the new item
  pb::DecodeStreamResponse m = RoundTrip(b);
  ASSERT_EQ(m.items_size(), 4);
  EXPECT_EQ(m.items(0).handle(), 0u);
  EXPECT_TRUE(m.items(0).has_error());
  EXPECT_EQ(m.items(1).handle(), 0u);  // handle 0 never continues an item
  EXPECT_EQ(m.items(1).token_ids_size(), 1);
  EXPECT_EQ(m.items(2).token_ids_size(), 1);
  EXPECT_EQ(m.items(3).first_index(), 4u);
  EXPECT_EQ(m.items(3).token_ids_size(), 2);
  // The next batch starts with nothing open.
  b.Tokens(3, 6, std::vector<uint32_t>{36});
  b.Finished(3, Fin(7));
  b.Tokens(3, 7, std::vector<uint32_t>{37});  // after the end: its own item
  m = RoundTrip(b);
  ASSERT_EQ(m.items_size(), 2);
  EXPECT_EQ(m.items(0).first_index(), 6u);
  EXPECT_TRUE(m.items(0).has_finished());
  EXPECT_EQ(m.items(1).first_index(), 7u);
  EXPECT_FALSE(m.items(1).has_finished());
}

// The quiet end (docs/decode-stream.md): a handle's item holding its first
// token alone (with `registered`) leaves the batch; the items after it keep
// taking their own events; any other item stays.
TEST(MuxBatcher, DropFirstTokenItemRemovesOnlyAFirstTokenAlone) {
  MuxBatcher b;
  b.Tokens(1, 0, std::vector<uint32_t>{10});
  b.Registered(2);
  b.Tokens(2, 0, std::vector<uint32_t>{20});
  b.Tokens(3, 4, std::vector<uint32_t>{34});
  b.Tokens(4, 0, std::vector<uint32_t>{40, 41});
  b.Tokens(5, 0, std::vector<uint32_t>{50});
  EXPECT_FALSE(b.DropFirstTokenItem(3));  // not the first token
  EXPECT_FALSE(b.DropFirstTokenItem(4));  // the first token and more
  EXPECT_FALSE(b.DropFirstTokenItem(6));  // no item
  EXPECT_TRUE(b.DropFirstTokenItem(2));   // `registered` and its first token: in the middle
  EXPECT_FALSE(b.DropFirstTokenItem(2));  // gone
  EXPECT_TRUE(b.DropFirstTokenItem(5));   // the last item
  // The items after the dropped one still continue where they were.
  b.Tokens(3, 5, std::vector<uint32_t>{35});
  b.Finished(4, Fin(2));
  b.Tokens(1, 1, std::vector<uint32_t>{11});
  const pb::DecodeStreamResponse m = RoundTrip(b);
  ASSERT_EQ(m.items_size(), 3);
  EXPECT_EQ(m.items(0).handle(), 1u);
  EXPECT_EQ(std::vector<uint32_t>(m.items(0).token_ids().begin(), m.items(0).token_ids().end()),
            (std::vector<uint32_t>{10, 11}));
  EXPECT_EQ(m.items(1).handle(), 3u);
  EXPECT_EQ(m.items(1).first_index(), 4u);
  EXPECT_EQ(m.items(1).token_ids_size(), 2);
  EXPECT_EQ(m.items(2).handle(), 4u);
  EXPECT_TRUE(m.items(2).has_finished());
  EXPECT_EQ(m.items(2).token_ids_size(), 2);
  // An item already taken is not in the next batch to drop.
  b.Tokens(7, 0, std::vector<uint32_t>{70});
  RoundTrip(b);
  EXPECT_FALSE(b.DropFirstTokenItem(7));
  EXPECT_TRUE(b.empty());
}

TEST(MuxBatcher, RandomInterleavingsReadBackAsEachRequestsOwnStream) {
  std::mt19937 rng(23);
  for (int round = 0; round < 50; ++round) {
    const uint64_t n = 1 + rng() % 40;
    std::map<uint64_t, uint32_t> produced;  // handle -> tokens so far
    std::map<uint64_t, uint32_t> length;    // handle -> tokens in all
    std::map<uint64_t, bool> fails;
    for (uint64_t h = 1; h <= n; ++h) {
      length[h] = rng() % 12;
      fails[h] = rng() % 5 == 0;
    }
    MuxBatcher b;
    pb::DecodeStreamResponse current;  // odd rounds: reused for every batch
    std::map<uint64_t, Seen> seen;
    int messages = 0;
    std::vector<uint64_t> live;
    for (uint64_t h = 1; h <= n; ++h) {
      b.Registered(h);
      live.push_back(h);
    }
    while (!live.empty()) {
      // A "step": every live request gets 0-2 tokens in some order, some
      // end; then the batch leaves with probability 1/2 (else it grows,
      // as while a write is in flight).
      std::shuffle(live.begin(), live.end(), rng);
      for (size_t i = 0; i < live.size();) {
        const uint64_t h = live[i];
        const uint32_t k = std::min<uint32_t>(rng() % 3, length[h] - produced[h]);
        std::vector<uint32_t> ids;
        for (uint32_t t = 0; t < k; ++t) ids.push_back(uint32_t(h * 1000 + produced[h] + t));
        b.Tokens(h, produced[h], ids);
        produced[h] += k;
        if (produced[h] == length[h]) {
          if (fails[h]) {
            b.Error(h, InternalError("boom " + std::to_string(h)));
          } else {
            b.Finished(h, Fin(length[h]));
          }
          live.erase(live.begin() + static_cast<long>(i));
        } else {
          ++i;
        }
      }
      if (rng() % 2 == 0 || live.empty()) {
        if (!b.empty()) {
          Demux(round % 2 == 0 ? RoundTrip(b) : RoundTripInto(b, current), seen);
          ++messages;
        }
      }
    }
    ASSERT_EQ(seen.size(), n);
    for (uint64_t h = 1; h <= n; ++h) {
      const Seen& s = seen[h];
      EXPECT_TRUE(s.registered) << h;
      EXPECT_FALSE(s.out_of_order) << h;
      ASSERT_EQ(s.tokens.size(), length[h]) << h;
      for (uint32_t t = 0; t < length[h]; ++t) EXPECT_EQ(s.tokens[t], h * 1000 + t);
      EXPECT_TRUE(s.ended);
      if (fails[h]) {
        EXPECT_EQ(s.error, "boom " + std::to_string(h));
        EXPECT_EQ(s.finished, 0);
      } else {
        EXPECT_EQ(s.finished, static_cast<int>(length[h]));
        EXPECT_TRUE(s.error.empty());
      }
      // At most one item per request per message.
      EXPECT_LE(s.items, messages) << h;
    }
  }
}

struct Counter final : Flushable {
  int flushes = 0;
  std::function<void()> on_flush;
  void FlushDeferred() override {
    ++flushes;
    if (on_flush) on_flush();
  }
};

TEST(DeliveryScope, DeferredFlushesRunWhenTheOutermostScopeEnds) {
  auto c = std::make_shared<Counter>();
  EXPECT_FALSE(DeliveryScope::Defer(c));  // no scope: the caller flushes itself
  {
    DeliveryScope outer;
    {
      DeliveryScope inner;
      EXPECT_TRUE(DeliveryScope::Defer(c));
    }
    EXPECT_EQ(c->flushes, 0);  // the inner scope's end is not the batch's
  }
  EXPECT_EQ(c->flushes, 1);
  // Inside a flush the scope is over: a Defer there is refused (the caller
  // flushes at once), so nothing waits for a scope that already ended.
  bool deferred_inside = true;
  c->on_flush = [&] { deferred_inside = DeliveryScope::Defer(c); };
  {
    DeliveryScope s;
    EXPECT_TRUE(DeliveryScope::Defer(c));
    EXPECT_TRUE(DeliveryScope::Defer(c));  // twice: flushed twice (a flush of nothing is harmless)
  }
  EXPECT_EQ(c->flushes, 3);
  EXPECT_FALSE(deferred_inside);
  EXPECT_FALSE(DeliveryScope::Defer(c));
}

// One clock reading per batch: every Now() of a scope (inner scopes and the
// deferred flushes included) is the first one's; outside, the clock.
TEST(DeliveryScope, NowIsOneReadingPerBatchItsFlushesIncluded) {
  using Clock = std::chrono::steady_clock;
  const Clock::time_point before = DeliveryScope::Now();
  Clock::time_point first, inner_now, flush_now;
  auto c = std::make_shared<Counter>();
  c->on_flush = [&] { flush_now = DeliveryScope::Now(); };
  {
    DeliveryScope outer;
    first = DeliveryScope::Now();
    while (Clock::now() == first) {
    }  // until the clock moved
    {
      DeliveryScope inner;
      inner_now = DeliveryScope::Now();
    }
    EXPECT_TRUE(DeliveryScope::Defer(c));
  }
  EXPECT_GE(first, before);
  EXPECT_EQ(inner_now, first);
  EXPECT_EQ(c->flushes, 1);
  EXPECT_EQ(flush_now, first);
  EXPECT_GT(DeliveryScope::Now(), first);  // outside: the clock
  {
    DeliveryScope next;  // a new batch reads the clock afresh
    EXPECT_GT(DeliveryScope::Now(), first);
  }
}

}  // namespace
}  // namespace tandem::decoder
