// The shared-memory communicator (src/parallel/shm_communicator.h): every
// operation across ranks that are threads of this process and ranks that are
// real processes (fork), payloads from one float to several max_bytes
// chunks, AllReduceSum bit-equal to a tree sum computed here, peer death
// (kill -9) and orderly leaving, join timeouts, stale segments.
#include "parallel/shm_communicator.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "common/splitmix.h"

namespace tandem::parallel {
namespace {

constexpr size_t kMaxBytes = 4096;  // 1024 floats a chunk: the payloads below span 0..5 chunks
constexpr int64_t kJoinMs = 20000;

std::string UniqueGroup(const std::string& what) {
  static std::atomic<int> counter{0};
  return "test-" + what + "-" + std::to_string(getpid()) + "-" + std::to_string(counter++);
}

bool SegmentExists(const std::string& group) {
  return access(("/dev/shm" + ShmCommunicator::SegmentName(group)).c_str(), F_OK) == 0;
}

// Rank r's input for payload `n`: signs and magnitudes 1e-3..1e6 mixed, so
// that the order of the additions changes the rounded sum.
std::vector<float> Input(int rank, size_t n) {
  std::vector<float> v(n);
  uint64_t state = 1000003ull * static_cast<uint64_t>(rank + 1) + n;
  for (size_t i = 0; i < n; ++i) {
    const uint64_t x = SplitMix64Next(state);
    const float mantissa = static_cast<float>(x & 0xffffff) / float(1 << 24) + 0.5f;
    const float scale = std::pow(10.0f, static_cast<float>(static_cast<int>((x >> 24) % 10) - 3));
    v[i] = ((x >> 40) & 1 ? -1.0f : 1.0f) * mantissa * scale;
  }
  return v;
}

// The tree of communicator.h, written out for the sizes the tests use.
float ReferenceTree(const std::vector<float>& x) {
  switch (x.size()) {
    case 1: return x[0];
    case 2: return x[0] + x[1];
    case 3: return (x[0] + x[1]) + x[2];
    case 4: return (x[0] + x[1]) + (x[2] + x[3]);
    case 8: return ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7]));
    default: ADD_FAILURE() << "no reference tree for " << x.size(); return 0;
  }
}

float LeftToRight(const std::vector<float>& x) {
  float s = x[0];
  for (size_t i = 1; i < x.size(); ++i) s += x[i];
  return s;
}

bool SameBits(float a, float b) { return std::memcmp(&a, &b, sizeof(float)) == 0; }

TEST(ShmCommunicatorTreeSum, MatchesTheReferenceTreeWhereLeftToRightDiffers) {
  // (1 + 1e8) + (-1e8 + 1) = 0 in float, ((1 + 1e8) - 1e8) + 1 = 1.
  const std::vector<float> chosen = {1.0f, 1e8f, -1e8f, 1.0f};
  ASSERT_NE(ReferenceTree(chosen), LeftToRight(chosen));
  const float* src[4] = {&chosen[0], &chosen[1], &chosen[2], &chosen[3]};
  float out = -7;
  ShmCommunicator::TreeSum(src, 4, &out, 1);
  EXPECT_TRUE(SameBits(out, ReferenceTree(chosen))) << out;

  for (int n : {1, 2, 3, 4, 8}) {
    const size_t count = 3000;  // more than one block of the general path
    std::vector<std::vector<float>> in;
    std::vector<const float*> ptrs;
    for (int r = 0; r < n; ++r) in.push_back(Input(r, count));
    for (auto& v : in) ptrs.push_back(v.data());
    std::vector<float> got(count);
    ShmCommunicator::TreeSum(ptrs.data(), n, got.data(), count);
    size_t order_matters = 0;
    for (size_t i = 0; i < count; ++i) {
      std::vector<float> x;
      for (int r = 0; r < n; ++r) x.push_back(in[r][i]);
      ASSERT_TRUE(SameBits(got[i], ReferenceTree(x))) << "n " << n << " element " << i;
      order_matters += !SameBits(ReferenceTree(x), LeftToRight(x));
    }
    if (n >= 4) {  // n = 3: the tree (r0 + r1) + r2 is the left-to-right order
      EXPECT_GT(order_matters, 0u) << "inputs too tame to tell the orders apart, n " << n;
    }
  }
}

// Every operation once per payload size; returns "" or what went wrong.
std::string RunAllOperations(Communicator& comm) {
  const int rank = comm.rank();
  const int size = comm.size();
  auto fail = [&](const std::string& what) {
    return "rank " + std::to_string(rank) + ": " + what;
  };
  for (size_t n : {size_t{0}, size_t{1}, size_t{3}, size_t{1023}, size_t{1024}, size_t{1025},
                   size_t{5000}}) {
    // AllReduceSum: bit-equal to the reference tree of everyone's inputs.
    std::vector<float> data = Input(rank, n);
    if (Status s = comm.AllReduceSum(data); !s.ok()) return fail(s.ToString());
    std::vector<std::vector<float>> all;
    for (int r = 0; r < size; ++r) all.push_back(Input(r, n));
    for (size_t i = 0; i < n; ++i) {
      std::vector<float> x;
      for (int r = 0; r < size; ++r) x.push_back(all[r][i]);
      if (!SameBits(data[i], ReferenceTree(x))) {
        return fail("AllReduceSum of " + std::to_string(n) + " floats, element " +
                    std::to_string(i) + ": " + std::to_string(data[i]) + " != " +
                    std::to_string(ReferenceTree(x)));
      }
    }
    // AllGather.
    std::vector<float> in = Input(rank + 100, n);
    std::vector<float> out(n * size, -1.0f);
    if (Status s = comm.AllGather(in, out); !s.ok()) return fail(s.ToString());
    for (int r = 0; r < size; ++r) {
      const std::vector<float> part(out.begin() + r * n, out.begin() + (r + 1) * n);
      if (part != Input(r + 100, n)) {
        return fail("AllGather of " + std::to_string(n) + " floats: rank " + std::to_string(r) +
                    "'s part differs");
      }
    }
    // Broadcast from the last rank, of n * 4 + 1 bytes (not a float multiple).
    const int root = size - 1;
    std::vector<std::byte> bytes(n * 4 + 1, std::byte{0});
    auto expected = [&](size_t i) { return std::byte(static_cast<uint8_t>(i * 7 + n)); };
    if (rank == root) {
      for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = expected(i);
    }
    if (Status s = comm.Broadcast(bytes, root); !s.ok()) return fail(s.ToString());
    for (size_t i = 0; i < bytes.size(); ++i) {
      if (bytes[i] != expected(i)) {
        return fail("Broadcast of " + std::to_string(bytes.size()) + " bytes, byte " +
                    std::to_string(i));
      }
    }
    // Send/Recv around the ring, two messages in order; even ranks send
    // first (a message of several chunks is a rendezvous).
    const int next = (rank + 1) % size;
    const int prev = (rank + size - 1) % size;
    auto message = [&](int from, int k) {
      std::vector<std::byte> m(n * 4 + static_cast<size_t>(k));
      for (size_t i = 0; i < m.size(); ++i) m[i] = std::byte(static_cast<uint8_t>(from * 31 + k + i));
      return m;
    };
    auto send = [&]() -> Status {
      for (int k = 0; k < 2; ++k) TANDEM_RETURN_IF_ERROR(comm.Send(message(rank, k), next));
      return Status::Ok();
    };
    auto recv = [&]() -> std::string {
      for (int k = 0; k < 2; ++k) {
        std::vector<std::byte> got(n * 4 + static_cast<size_t>(k));
        if (Status s = comm.Recv(got, prev); !s.ok()) return s.ToString();
        if (got != message(prev, k)) return "message " + std::to_string(k) + " differs";
      }
      return "";
    };
    if (size > 1) {
      std::string err;
      if (rank % 2 == 0) {
        if (Status s = send(); !s.ok()) return fail(s.ToString());
        err = recv();
      } else {
        err = recv();
        if (Status s = send(); err.empty() && !s.ok()) err = s.ToString();
      }
      if (!err.empty()) return fail("Send/Recv of " + std::to_string(n * 4) + " bytes: " + err);
    }
    if (Status s = comm.Barrier(); !s.ok()) return fail(s.ToString());
  }
  return "";
}

void RunThreads(int size, const std::function<void(int)>& body) {
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) threads.emplace_back(body, r);
  for (auto& t : threads) t.join();
}

TEST(ShmCommunicator, EveryOperationAcrossThreadRanks) {
  for (int size : {1, 2, 3, 4}) {
    const std::string group = UniqueGroup("threads");
    std::vector<std::string> errors(size);
    RunThreads(size, [&](int r) {
      auto comm = CreateShmCommunicator(group, r, size, kJoinMs, kMaxBytes);
      if (!comm.ok()) {
        errors[r] = comm.status().ToString();
        return;
      }
      errors[r] = RunAllOperations(**comm);
    });
    for (int r = 0; r < size; ++r) EXPECT_EQ(errors[r], "") << "size " << size;
    EXPECT_FALSE(SegmentExists(group)) << "the segment name must be gone once the group formed";
  }
}

// Forks `size` rank processes running `body(rank)` (its return value is the
// exit code); SIGALRM ends a child that hangs, so a hang is a failure and
// leaves nothing behind.
std::vector<pid_t> ForkRanks(int size, const std::function<int(int)>& body) {
  std::vector<pid_t> pids;
  for (int r = 0; r < size; ++r) {
    const pid_t pid = fork();
    if (pid == 0) {
      alarm(60);
      _exit(body(r));
    }
    pids.push_back(pid);
  }
  return pids;
}

// "exit N" or "signal N".
std::string WaitExit(pid_t pid) {
  int status = 0;
  if (waitpid(pid, &status, 0) != pid) return "waitpid failed";
  if (WIFEXITED(status)) return "exit " + std::to_string(WEXITSTATUS(status));
  return "signal " + std::to_string(WTERMSIG(status));
}

TEST(ShmCommunicator, EveryOperationAcrossFourProcesses) {
  const std::string group = UniqueGroup("procs");
  const auto pids = ForkRanks(4, [&](int r) {
    auto comm = CreateShmCommunicator(group, r, 4, kJoinMs, kMaxBytes);
    if (!comm.ok()) {
      fprintf(stderr, "rank %d: %s\n", r, comm.status().ToString().c_str());
      return 1;
    }
    const std::string err = RunAllOperations(**comm);
    if (!err.empty()) fprintf(stderr, "%s\n", err.c_str());
    return err.empty() ? 0 : 2;
  });
  for (int r = 0; r < 4; ++r) EXPECT_EQ(WaitExit(pids[r]), "exit 0") << "rank " << r;
  EXPECT_FALSE(SegmentExists(group));
}

TEST(ShmCommunicator, KillNineMidCollectivesFailsEveryOtherRankNamingIt) {
  const std::string group = UniqueGroup("kill");
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  // Every rank runs AllReduceSums of two chunks; rank 3 tells the test after
  // its 20th and carries on until killed.
  const auto pids = ForkRanks(4, [&](int r) {
    close(ready[0]);
    auto comm = CreateShmCommunicator(group, r, 4, kJoinMs, kMaxBytes);
    if (!comm.ok()) return 1;
    std::vector<float> data(1500, 1.0f);
    Status s;
    for (int i = 0; i < 10'000'000 && s.ok(); ++i) {
      s = (*comm)->AllReduceSum(data);
      if (r == 3 && i == 20) {
        const char c = 'x';
        if (write(ready[1], &c, 1) != 1) return 3;
      }
    }
    if (s.code() != StatusCode::kUnavailable || s.message().find("rank 3 (pid ") == std::string::npos) {
      fprintf(stderr, "rank %d: %s\n", r, s.ToString().c_str());
      return 4;
    }
    // Later calls fail the same way, at once.
    const Status later = (*comm)->Barrier();
    if (later.code() != StatusCode::kUnavailable) {
      fprintf(stderr, "rank %d later: %s\n", r, later.ToString().c_str());
      return 5;
    }
    return 0;
  });
  close(ready[1]);
  char c = 0;
  ASSERT_EQ(read(ready[0], &c, 1), 1) << "rank 3 never completed 20 all-reduces";
  close(ready[0]);
  ASSERT_EQ(kill(pids[3], SIGKILL), 0);
  EXPECT_EQ(WaitExit(pids[3]), "signal 9");
  for (int r = 0; r < 3; ++r) EXPECT_EQ(WaitExit(pids[r]), "exit 0") << "rank " << r;
}

TEST(ShmCommunicator, KillNineDuringAPendingRecvFailsIt) {
  const std::string group = UniqueGroup("killrecv");
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  const auto pids = ForkRanks(2, [&](int r) {
    close(ready[0]);
    auto comm = CreateShmCommunicator(group, r, 2, kJoinMs, kMaxBytes);
    if (!comm.ok()) return 1;
    if (r == 1) {  // joined: tell the test, then never send
      const char c = 'x';
      if (write(ready[1], &c, 1) != 1) return 3;
      pause();
      return 0;
    }
    std::vector<std::byte> buf(100);
    const Status s = (*comm)->Recv(buf, 1);
    if (s.code() != StatusCode::kUnavailable || s.message().find("rank 1 (pid ") == std::string::npos) {
      fprintf(stderr, "rank 0: %s\n", s.ToString().c_str());
      return 4;
    }
    return 0;
  });
  close(ready[1]);
  char c = 0;
  ASSERT_EQ(read(ready[0], &c, 1), 1);
  close(ready[0]);
  ASSERT_EQ(kill(pids[1], SIGKILL), 0);
  // Rank 1 stays a zombie until reaped below: rank 0 must see it as dead.
  EXPECT_EQ(WaitExit(pids[0]), "exit 0");
  EXPECT_EQ(WaitExit(pids[1]), "signal 9");
}

TEST(ShmCommunicator, APeerThatLeftFailsCallsWaitingOnIt) {
  const std::string group = UniqueGroup("left");
  Status got;
  RunThreads(2, [&](int r) {
    auto comm = CreateShmCommunicator(group, r, 2, kJoinMs, kMaxBytes);
    ASSERT_TRUE(comm.ok()) << comm.status().ToString();
    if (r == 1) return;  // leaves at once
    std::vector<float> data(4, 1.0f);
    got = (*comm)->AllReduceSum(data);
  });
  EXPECT_EQ(got.code(), StatusCode::kUnavailable) << got.ToString();
  EXPECT_NE(got.message().find("rank 1 (pid "), std::string::npos) << got.ToString();
  EXPECT_NE(got.message().find("left the group"), std::string::npos) << got.ToString();
}

TEST(ShmCommunicator, MismatchedCallsAreInternalErrorsOnBothRanks) {
  const std::string group = UniqueGroup("mismatch");
  std::vector<Status> got(2);
  RunThreads(2, [&](int r) {
    auto comm = CreateShmCommunicator(group, r, 2, kJoinMs, kMaxBytes);
    ASSERT_TRUE(comm.ok()) << comm.status().ToString();
    std::vector<float> data(r == 0 ? 8 : 16, 1.0f);
    got[r] = (*comm)->AllReduceSum(data);
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(got[r].code(), StatusCode::kInternal) << got[r].ToString();
    EXPECT_NE(got[r].message().find("AllReduceSum(32 bytes)"), std::string::npos) << got[r].ToString();
    EXPECT_NE(got[r].message().find("AllReduceSum(64 bytes)"), std::string::npos) << got[r].ToString();
  }
}

TEST(ShmCommunicator, JoinTimeoutNamesTheMissingRanksAndLeavesNoSegment) {
  const std::string group = UniqueGroup("timeout");
  std::vector<Status> got(4);
  RunThreads(2, [&](int i) {
    const int r = i == 0 ? 0 : 2;  // ranks 1 and 3 never come
    auto comm = CreateShmCommunicator(group, r, 4, 1000, kMaxBytes);
    got[r] = comm.status();
  });
  for (int r : {0, 2}) {
    EXPECT_EQ(got[r].code(), StatusCode::kDeadlineExceeded) << got[r].ToString();
    EXPECT_NE(got[r].message().find("rank(s) 1, 3 of 4 did not join within 1000 ms (the ranks "
                                    "of a group must run on this host"),
              std::string::npos)
        << got[r].ToString();
  }
  EXPECT_FALSE(SegmentExists(group));
}

TEST(ShmCommunicator, BadArgumentsNameTheLimit) {
  auto bad_rank = CreateShmCommunicator(UniqueGroup("bad"), 2, 2, 100, kMaxBytes);
  EXPECT_EQ(bad_rank.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad_rank.status().message().find("rank 2 is outside 0..1"), std::string::npos);
  auto bad_bytes = CreateShmCommunicator(UniqueGroup("bad"), 0, 2, 100, 8);
  EXPECT_EQ(bad_bytes.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad_bytes.status().message().find("max_bytes 8 is outside"), std::string::npos);

  // A rank that disagrees on the group's size is refused; the group then
  // forms with the right one.
  const std::string group = UniqueGroup("size");
  Status first, second, third;
  std::thread t([&] { first = CreateShmCommunicator(group, 0, 2, kJoinMs, kMaxBytes).status(); });
  while (!SegmentExists(group)) std::this_thread::yield();
  second = CreateShmCommunicator(group, 1, 3, kJoinMs, kMaxBytes).status();
  {
    auto right = CreateShmCommunicator(group, 1, 2, kJoinMs, kMaxBytes);
    third = right.status();
  }
  t.join();
  EXPECT_EQ(second.code(), StatusCode::kInvalidArgument) << second.ToString();
  EXPECT_NE(second.message().find("exists with size 2 and max_bytes 4096; rank 1 asked for size 3"),
            std::string::npos)
      << second.ToString();
  EXPECT_TRUE(third.ok()) << third.ToString();
  EXPECT_TRUE(first.ok()) << first.ToString();
}

// /proc/<pid>/stat's state letter.
char ProcessState(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  std::getline(f, line);
  const auto p = line.rfind(')');
  return p == std::string::npos || p + 2 >= line.size() ? '?' : line[p + 2];
}

TEST(ShmCommunicator, ASegmentLeftByACrashedJoinIsReplaced) {
  const std::string group = UniqueGroup("stale");
  // A rank process that creates the group, joins, and is killed while it
  // waits (asleep on the futex) for its peer.
  const auto pids = ForkRanks(1, [&](int) {
    return CreateShmCommunicator(group, 0, 2, kJoinMs, kMaxBytes).ok() ? 0 : 1;
  });
  for (int i = 0; i < 5000 && !(SegmentExists(group) && ProcessState(pids[0]) == 'S'); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_TRUE(SegmentExists(group));
  ASSERT_EQ(kill(pids[0], SIGKILL), 0);
  EXPECT_EQ(WaitExit(pids[0]), "signal 9");
  ASSERT_TRUE(SegmentExists(group)) << "the crashed join leaves its segment behind";

  // A new group of the same name forms and works.
  std::vector<std::string> errors(2);
  RunThreads(2, [&](int r) {
    auto comm = CreateShmCommunicator(group, r, 2, kJoinMs, kMaxBytes);
    errors[r] = comm.ok() ? RunAllOperations(**comm) : comm.status().ToString();
  });
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
  EXPECT_FALSE(SegmentExists(group));
}

}  // namespace
}  // namespace tandem::parallel
