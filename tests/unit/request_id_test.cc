// Fleet request ids (common/request_id.h; issue 23): 32 lowercase hex
// digits of the kernel's CSPRNG handed out from a per-thread pool. Ids
// never repeat across the pool's refills nor across threads, and a forked
// child does not hand out the ids its parent will (it drops the pool it
// inherited).
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "common/request_id.h"

namespace tandem {
namespace {

bool IsNonce(const std::string& s) {
  return s.size() == kFleetNonceChars && std::all_of(s.begin(), s.end(), [](char c) {
           return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
         });
}

TEST(RequestIdPool, IdsStayDistinctAcrossRefillsAndThreads) {
  constexpr int kThreads = 4;
  constexpr int kIds = 1000;  // ~4 pool refills a thread
  std::vector<std::vector<std::string>> ids(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&ids, t] {
      for (int i = 0; i < kIds; ++i) ids[t].push_back(RandomHex128());
    });
  }
  for (std::thread& t : threads) t.join();
  std::set<std::string> seen;
  for (const auto& list : ids) {
    for (const std::string& id : list) {
      EXPECT_TRUE(IsNonce(id)) << id;
      EXPECT_TRUE(seen.insert(id).second) << "repeated: " << id;
    }
  }
  EXPECT_EQ(seen.size(), size_t{kThreads} * kIds);
  // Random bits, not a counter: each hex digit's 16 values all show up in
  // the first position over 4,000 ids (missing one has odds ~16 * (15/16)^4000).
  std::set<char> first;
  for (const std::string& id : seen) first.insert(id[0]);
  EXPECT_EQ(first.size(), 16u);
}

TEST(RequestIdPool, AForkedChildDoesNotRepeatItsParentsIds) {
  const std::string before = RandomHex128();  // the parent's pool is filled
  ASSERT_TRUE(IsNonce(before));
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    std::string ids;
    for (int i = 0; i < 8; ++i) ids += RandomHex128();
    const ssize_t n = write(fds[1], ids.data(), ids.size());
    _exit(n == static_cast<ssize_t>(ids.size()) ? 0 : 1);
  }
  close(fds[1]);
  std::string child;
  char buf[512];
  for (ssize_t n; (n = read(fds[0], buf, sizeof buf)) > 0;) child.append(buf, static_cast<size_t>(n));
  close(fds[0]);
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  ASSERT_EQ(child.size(), 8 * kFleetNonceChars);
  std::set<std::string> parent;
  for (int i = 0; i < 8; ++i) parent.insert(RandomHex128());
  for (size_t i = 0; i < 8; ++i) {
    const std::string id = child.substr(i * kFleetNonceChars, kFleetNonceChars);
    EXPECT_TRUE(IsNonce(id)) << id;
    EXPECT_EQ(parent.count(id), 0u) << "the child handed out its parent's id " << id;
  }
}

}  // namespace
}  // namespace tandem
