// Quiet reading's mark (src/proxy/h2/h2_acks.h QuietMarkFor,
// docs/grpc-frontend.md "Quiet reading"): the acknowledgements of the
// batches between two reads never wake the event thread, yet once one
// batch's acknowledgements are in the socket a request of 80 bytes (its own
// TLS record around it) does; a client that does not acknowledge every
// batch, or one batch's acknowledgements at the cap, get one batch per read.
#include <gtest/gtest.h>

#include "proxy/h2/h2_acks.h"

namespace tandem::proxy::h2 {
namespace {

constexpr int kRequest = 80;  // the smallest request that must never wait for a read

TEST(QuietMarkTest, StepsWaitingInTheSocketNeverWakeAndARequestAfterOneStepAlwaysDoes) {
  for (int overhead : {0, 22, 29}) {  // plaintext, TLS 1.3, TLS 1.2 AES-GCM
    for (int streams = 1; streams <= 300; ++streams) {
      SCOPED_TRACE(testing::Message() << "streams " << streams << " overhead " << overhead);
      const int step = StepAckBytes(streams) + overhead;
      const QuietMark m = QuietMarkFor(streams, overhead, /*acks_each_step=*/true);
      ASSERT_GE(m.read_every, 1);
      if (step < kRequest) {
        // The batches between two reads: their acknowledgements stay below.
        EXPECT_LT(m.read_every * step, m.low_water);
        // One batch's acknowledgements in, then a request's record.
        EXPECT_GE(step + kRequest + overhead, m.low_water);
        EXPECT_GE(m.read_every, 2);
      } else {
        // At the cap: every batch reads, the mark as with one step.
        EXPECT_EQ(m.read_every, 1);
        EXPECT_LE(m.low_water, kRequest + overhead);
      }
      // A client that acknowledges lazily: one batch, the mark just above
      // one batch's acknowledgements, at most the cap.
      const QuietMark lazy = QuietMarkFor(streams, overhead, /*acks_each_step=*/false);
      EXPECT_EQ(lazy.read_every, 1);
      EXPECT_EQ(lazy.low_water, std::min(StepAckBytes(streams) + 1, kRequest) + overhead);
    }
  }
}

TEST(QuietMarkTest, TheBenchmarksConnectionsReadEveryOtherOrFourthBatch) {
  // `tandem bench proxy` stream: 16 streams over 4 plaintext connections.
  EXPECT_EQ(QuietMarkFor(4, 0, true).read_every, 2);
  EXPECT_EQ(QuietMarkFor(4, 0, true).low_water, 2 * 65 + 1);
  EXPECT_EQ(QuietMarkFor(1, 0, true).read_every, 4);
  // TLS 1.3: one step's record of 4 streams is 87 bytes, past the cap.
  EXPECT_EQ(QuietMarkFor(4, 22, true).read_every, 1);
  EXPECT_EQ(QuietMarkFor(4, 22, true).low_water, 66 + 22);
}

}  // namespace
}  // namespace tandem::proxy::h2
