// The SSE path's pieces (issue 23): SseEncoder must write exactly the bytes
// of openai.h's DOM rendering (StreamDelta framed by Chunk) for any text,
// and Outbox must send in order, directly when the socket takes the bytes
// and through the strand's flush when it does not, and never after Close.
// The whole path runs in tests/integration/http/openai_client_test.py.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <random>
#include <string>
#include <vector>

#include "http/http_outbox.h"
#include "http/sse_encoder.h"

namespace tandem::http {
namespace {

std::vector<std::string> Texts() {
  std::vector<std::string> t = {"",
                                "a",
                                " the",
                                "quote \" backslash \\ slash /",
                                "\n\r\t\b\f",
                                std::string("nul \0 here", 10),
                                "\x01\x1f\x7f",
                                "caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80",  // é € 😀
                                "\xff",                                        // invalid
                                "\xc3",                                        // truncated
                                "\xe0\x80\x80",                                // overlong
                                "\xed\xa0\x80",                                // surrogate
                                "\xf4\x90\x80\x80",                            // past U+10FFFF
                                "ok \xc3\xa9 then bad \xc3\x28 end"};
  for (int c = 0; c < 256; ++c) t.push_back(std::string(1, static_cast<char>(c)) + "x");
  std::mt19937 rng(7);
  for (int i = 0; i < 2000; ++i) {
    std::string s(rng() % 12, '\0');
    for (char& ch : s) ch = static_cast<char>(rng() % 256);
    t.push_back(s);
  }
  return t;
}

TEST(SseEncoder, SameBytesAsTheDomRendering) {
  for (Endpoint ep : {Endpoint::kCompletions, Endpoint::kChat}) {
    for (bool usage : {false, true}) {
      ResponseMeta m{ep, "cmpl-id \"quoted\" \xc3\xa9", 1700000000, "llama/\\model"};
      SseEncoder enc(m, usage);
      for (const std::string& text : Texts()) {
        for (bool first : {true, false}) {
          std::string got = "prefix";
          enc.AppendDelta(got, text, first);
          ASSERT_EQ(got, "prefix" + Chunk(StreamDelta(m, text, first, usage)))
              << "endpoint " << int(ep) << " usage " << usage << " first " << first;
        }
      }
    }
  }
}

TEST(SseEncoder, ChunkFraming) {
  EXPECT_EQ(Chunk(""), "0\r\n\r\n");
  EXPECT_EQ(Chunk(std::string(26, 'z')), "1a\r\n" + std::string(26, 'z') + "\r\n");
}

TEST(SseEncoder, EscapingRefusesInvalidUtf8) {
  std::string out = "x";
  EXPECT_TRUE(AppendJsonEscaped(out, "a\"\x01\xc3\xa9"));
  EXPECT_EQ(out, "xa\\\"\\u0001\xc3\xa9");
  EXPECT_FALSE(AppendJsonEscaped(out, "ok\xff"));
  EXPECT_EQ(out, "xa\\\"\\u0001\xc3\xa9");  // nothing appended
}

// A connected socket pair: [0] is the server's side the Outbox writes.
struct Pair {
  int fd[2] = {-1, -1};
  Pair() {
    EXPECT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, fd), 0);
    fcntl(fd[0], F_SETFL, fcntl(fd[0], F_GETFL) | O_NONBLOCK);
  }
  ~Pair() {
    for (int f : fd) {
      if (f >= 0) close(f);
    }
  }
  std::string ReadAll() {
    std::string out;
    char buf[65536];
    for (ssize_t n; (n = recv(fd[1], buf, sizeof buf, MSG_DONTWAIT)) > 0;) out.append(buf, n);
    return out;
  }
};

TEST(Outbox, SendsDirectlyWhenTheSocketTakesTheBytes) {
  Pair p;
  int flushes = 0, failures = 0;
  Outbox out(p.fd[0], [&] { ++flushes; }, [&] { ++failures; });
  out.Write("hello ");
  out.Write("world");
  EXPECT_EQ(p.ReadAll(), "hello world");
  EXPECT_EQ(flushes, 0);
  EXPECT_FALSE(out.Writing());
  EXPECT_EQ(failures, 0);
}

TEST(Outbox, QueuesWhatTheSocketDoesNotTakeAndKeepsTheOrder) {
  Pair p;
  int flushes = 0;
  Outbox out(p.fd[0], [&] { ++flushes; }, [] {});
  // More than the socket buffers: the rest waits for the strand's flush.
  const std::string big(8u << 20, 'b');
  out.Write(big);
  EXPECT_EQ(flushes, 1);
  EXPECT_TRUE(out.Writing());
  out.Write("after");  // queued behind, never sent ahead
  EXPECT_EQ(flushes, 1);
  std::string got = p.ReadAll();
  std::string rest;
  ASSERT_TRUE(out.TakePending(rest));
  got += rest;
  EXPECT_EQ(got, big + "after");
  EXPECT_FALSE(out.TakePending(rest));  // the flush ends
  EXPECT_FALSE(out.Writing());
  out.Write("direct again");
  EXPECT_EQ(p.ReadAll(), "direct again");
  EXPECT_EQ(flushes, 1);
}

TEST(Outbox, WithoutADescriptorEverythingGoesThroughTheFlush) {
  int flushes = 0;
  Outbox out(-1, [&] { ++flushes; }, [] {});  // TLS
  out.Write("a");
  out.Write("b");
  EXPECT_EQ(flushes, 1);
  std::string rest;
  ASSERT_TRUE(out.TakePending(rest));
  EXPECT_EQ(rest, "ab");
  EXPECT_FALSE(out.TakePending(rest));
}

TEST(Outbox, NothingIsWrittenAfterClose) {
  Pair p;
  Outbox out(p.fd[0], [] {}, [] {});
  out.BeginGeneration(true, "HEAD\r\n\r\n", SseEncoder({}, false));
  out.Close();
  out.Write("x");
  out.Delta("token");
  out.EndStream("tail");
  EXPECT_EQ(p.ReadAll(), "");
}

TEST(Outbox, AFailedSendReportsTheClientGone) {
  Pair p;
  int failures = 0;
  Outbox out(p.fd[0], [] {}, [&] { ++failures; });
  close(p.fd[1]);
  p.fd[1] = -1;
  out.Write("x");
  EXPECT_EQ(failures, 1);
  out.Write("y");  // closed since: reported once
  EXPECT_EQ(failures, 1);
}

TEST(Outbox, StreamSendsTheHeadWithTheFirstEventInOneWrite) {
  Pair p;
  Outbox out(p.fd[0], [] {}, [] {});
  ResponseMeta m{Endpoint::kChat, "chatcmpl-1", 1, "m"};
  out.BeginGeneration(true, "HEAD\r\n\r\n", SseEncoder(m, false));
  EXPECT_FALSE(out.HeadSent());
  out.Delta("");  // no text yet: the head only
  EXPECT_TRUE(out.HeadSent());
  out.Delta("Hi");
  out.Delta(" there");
  out.EndStream("0\r\n\r\n");
  EXPECT_EQ(p.ReadAll(), "HEAD\r\n\r\n" + Chunk(StreamDelta(m, "Hi", true, false)) +
                             Chunk(StreamDelta(m, " there", false, false)) + "0\r\n\r\n");
}

TEST(Outbox, NotStreamedTextCollects) {
  Pair p;
  Outbox out(p.fd[0], [] {}, [] {});
  out.BeginGeneration(false, "HEAD\r\n\r\n", SseEncoder());
  out.Delta("a");
  out.Delta("b");
  EXPECT_EQ(out.TakeText(), "ab");
  EXPECT_FALSE(out.HeadSent());
  EXPECT_EQ(p.ReadAll(), "");
  // A stream that ends before any event still gets its head.
  out.BeginGeneration(true, "HEAD\r\n\r\n", SseEncoder());
  out.EndStream("end");
  EXPECT_EQ(p.ReadAll(), "HEAD\r\n\r\nend");
}

}  // namespace
}  // namespace tandem::http
