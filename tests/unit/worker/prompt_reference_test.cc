// The prompt goes once (docs/decode-stream.md): a decoder registered with
// the prompt by reference (its length and digest, DecodeSpec::prompt_ref)
// takes the tokens from the prefiller's Reserve. The Reserve must bring
// exactly that prompt (else INVALID_ARGUMENT and nothing reserved, the
// registration kept); the request then decodes as one registered with its
// tokens does, and its blocks are cached under that prompt's hashes. A
// reference is refused with tokens beside it, with a local prefill, and
// where its length alone breaks the engine's limits. Real engine, loopback
// transport; the wire runs in prompt_encoding_test and with real processes
// in tests/integration/serving (PromptByReferenceTest).
#include <fmt/format.h>

#include <optional>

#include "common/block_hash.h"
#include "worker_test_util.h"

namespace tandem::worker_test {
namespace {

using decoder::Decoder;
using decoder::DecoderOptions;
using decoder::DecodeSpec;

class PromptReferenceTest : public ::testing::Test {
 protected:
  struct Side {
    std::unique_ptr<Node> node;
    std::unique_ptr<Decoder> decoder;
  };
  static Side MakeSide(const std::string& name) {
    Side s;
    s.node = Node::Make(name, 32);
    if (!s.node) return s;
    DecoderOptions o;
    o.verify_checksums = false;
    s.decoder = std::make_unique<Decoder>(*s.node->engine, *s.node->transport, o);
    s.decoder->Start();
    return s;
  }
  void TearDown() override {
    for (Side* s : {&a_, &b_}) {
      if (s->decoder) s->decoder->Stop();
    }
  }
  static DecodeSpec ByValue(const std::string& id, const std::vector<uint32_t>& prompt) {
    DecodeSpec s;
    s.request_id = id;
    s.prompt_ids = prompt;
    s.sampling = Greedy(4);
    return s;
  }
  static DecodeSpec ByReference(const std::string& id, const std::vector<uint32_t>& prompt) {
    DecodeSpec s;
    s.request_id = id;
    s.prompt_ref =
        DecodeSpec::PromptRef{static_cast<uint32_t>(prompt.size()), PromptDigest(prompt)};
    s.sampling = Greedy(4);
    return s;
  }
  // Reserves `prompt` for `id`, sends the KV notice, and waits for the end.
  static std::shared_ptr<RecordingSink> Decode(Decoder& d, const DecodeSpec& spec,
                                               const std::vector<uint32_t>& prompt) {
    auto sink = std::make_shared<RecordingSink>();
    EXPECT_TRUE(d.Register(spec, sink).ok());
    auto t = d.Reserve(spec.request_id, "p", prompt);
    EXPECT_TRUE(t.ok()) << t.status().ToString();
    if (!t.ok()) return sink;
    d.OnKvNotice(SuccessNotice(*t, 7));
    EXPECT_TRUE(WaitFor([&] { return sink->Ended(); }));
    return sink;
  }
  static uint32_t FreeBlocks(const Side& s) { return s.node->engine->stats().free_blocks; }

  Side a_, b_;
};

TEST_F(PromptReferenceTest, ARequestByReferenceDecodesThePromptItsReserveBrings) {
  a_ = MakeSide("by-value");
  b_ = MakeSide("by-reference");
  ASSERT_TRUE(a_.decoder && b_.decoder);
  const std::vector<uint32_t> prompt = Prompt(40, 5);  // two full blocks and a part
  auto by_value = Decode(*a_.decoder, ByValue("r", prompt), prompt);
  auto by_ref = Decode(*b_.decoder, ByReference("r", prompt), prompt);
  {
    std::scoped_lock lock(by_value->mu_, by_ref->mu_);
    ASSERT_TRUE(by_value->finished) << by_value->error.ToString();
    ASSERT_TRUE(by_ref->finished) << by_ref->error.ToString();
    EXPECT_EQ(by_ref->tokens.size(), 4u);
    EXPECT_EQ(by_ref->tokens[0], 7u);             // the prefiller's first token
    EXPECT_EQ(by_ref->tokens, by_value->tokens);  // same engine, same KV, same prompt
  }
  // Its blocks are cached under the Reserve's prompt: the next request for
  // that prompt finds both full blocks here; another prompt finds none.
  auto again = b_.decoder->Reserve("s", "p", prompt);
  EXPECT_EQ(again.status().code(), StatusCode::kNotFound);  // not registered
  ASSERT_TRUE(b_.decoder->Register(ByValue("s", prompt), std::make_shared<RecordingSink>()).ok());
  again = b_.decoder->Reserve("s", "p", prompt);
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(again->cached_blocks, 2u);
  const std::vector<uint32_t> other = Prompt(40, 6);
  ASSERT_TRUE(b_.decoder->Register(ByValue("o", other), std::make_shared<RecordingSink>()).ok());
  auto fresh = b_.decoder->Reserve("o", "p", other);
  ASSERT_TRUE(fresh.ok()) << fresh.status().ToString();
  EXPECT_EQ(fresh->cached_blocks, 0u);
}

TEST_F(PromptReferenceTest, AReserveWithAnotherPromptIsRefusedAndReservesNothing) {
  a_ = MakeSide("mismatch");
  ASSERT_TRUE(a_.decoder);
  const std::vector<uint32_t> prompt = Prompt(40, 5);
  auto sink = std::make_shared<RecordingSink>();
  ASSERT_TRUE(a_.decoder->Register(ByReference("r", prompt), sink).ok());
  std::vector<uint32_t> one_changed = prompt;
  one_changed[17] += 1;
  std::vector<uint32_t> longer = prompt;
  longer.push_back(3);
  std::vector<uint32_t> shorter(prompt.begin(), prompt.end() - 1);
  for (const std::vector<uint32_t>* wrong : {&one_changed, &longer, &shorter}) {
    SCOPED_TRACE(wrong->size());
    auto t = a_.decoder->Reserve("r", "p", *wrong);
    ASSERT_FALSE(t.ok());
    EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(t.status().message().find(fmt::format(
                  "the prompt to reserve ({} tokens) differs from the registered one (40 tokens, "
                  "digest {:016x})",
                  wrong->size(), PromptDigest(prompt))),
              std::string::npos)
        << t.status().ToString();
    EXPECT_EQ(FreeBlocks(a_), 32u);
    EXPECT_EQ(a_.decoder->counts().reservations, 0u);
    EXPECT_EQ(a_.decoder->counts().seats_taken, 0u);
  }
  // The registration stays: the right prompt reserves and decodes.
  auto t = a_.decoder->Reserve("r", "p", prompt);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  a_.decoder->OnKvNotice(SuccessNotice(*t, 7));
  ASSERT_TRUE(WaitFor([&] { return sink->Ended(); }));
  std::lock_guard lock(sink->mu_);
  EXPECT_TRUE(sink->finished) << sink->error.ToString();
  EXPECT_EQ(sink->tokens.size(), 4u);
}

// The digest vouches for the tokens the proxy was sent, not their range:
// the engine checks the ids when the Reserve brings them.
TEST_F(PromptReferenceTest, OutOfRangeIdsByReferenceAreRefusedWhenTheReserveBringsThem) {
  a_ = MakeSide("range");
  ASSERT_TRUE(a_.decoder);
  std::vector<uint32_t> prompt = Prompt(40, 5);
  prompt[3] = Tiny().config.vocab_size;
  ASSERT_TRUE(
      a_.decoder->Register(ByReference("r", prompt), std::make_shared<RecordingSink>()).ok());
  auto t = a_.decoder->Reserve("r", "p", prompt);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(t.status().message().find(
                fmt::format("prompt token id {} is out of range", Tiny().config.vocab_size)),
            std::string::npos)
      << t.status().ToString();
  EXPECT_EQ(FreeBlocks(a_), 32u);
  EXPECT_EQ(a_.decoder->counts().seats_taken, 0u);
}

TEST_F(PromptReferenceTest, ABadReferenceIsRefusedAtRegistration) {
  a_ = MakeSide("refusals");
  ASSERT_TRUE(a_.decoder);
  const std::vector<uint32_t> prompt = Prompt(40, 5);
  struct Case {
    const char* what;
    DecodeSpec spec;
    std::string want;
  };
  std::vector<Case> cases;
  {
    DecodeSpec both = ByReference("both", prompt);
    both.prompt_ids = prompt;
    cases.push_back({"tokens and a reference", both,
                     "request 'both' carries both the prompt's 40 tokens and a prompt reference "
                     "(prompt_length 40); send one"});
  }
  {
    DecodeSpec local = ByReference("local", prompt);
    local.prefill_locally = true;
    cases.push_back({"a local prefill", local,
                     "request 'local': prefill_locally needs the prompt's tokens, not a reference "
                     "(prompt_length 40)"});
  }
  {
    DecodeSpec empty = ByReference("empty", prompt);
    empty.prompt_ref->length = 0;
    cases.push_back({"no tokens", empty, "the prompt has no tokens"});
  }
  {
    const uint32_t context = a_.node->engine->max_model_len();
    DecodeSpec big = ByReference("big", prompt);
    big.prompt_ref->length = context - 2;  // with max_tokens 4: past the context
    cases.push_back({"past the context", big,
                     fmt::format("prompt has {} tokens and max_tokens is 4: {} tokens exceed this "
                                 "model's context of {}",
                                 context - 2, context + 2, context)});
  }
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    Status s = a_.decoder->Register(c.spec, std::make_shared<RecordingSink>());
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find(c.want), std::string::npos) << s.ToString();
    // Nothing registered: its Reserve finds no request (it ended here).
    auto t = a_.decoder->Reserve(c.spec.request_id, "p", prompt);
    EXPECT_EQ(t.status().code(), StatusCode::kNotFound) << t.status().ToString();
  }
  EXPECT_EQ(FreeBlocks(a_), 32u);
  EXPECT_EQ(a_.decoder->counts().seats_taken, 0u);
}

// The prefiller's Reserve may overtake the start (Prefill with the start):
// held until the registration by reference comes, then checked against it.
TEST_F(PromptReferenceTest, AHeldReserveIsCheckedAgainstTheReferenceWhenItRegisters) {
  a_ = MakeSide("held");
  ASSERT_TRUE(a_.decoder);
  const std::vector<uint32_t> prompt = Prompt(40, 5);
  const std::vector<uint32_t> other = Prompt(40, 6);
  Answer right, wrong;
  bool waits = false;
  const auto until = std::chrono::steady_clock::now() + 10s;
  EXPECT_NE(a_.decoder->ReserveOrWait("r", "p", prompt, {}, {}, until, right.Done(), &waits), 0u);
  EXPECT_TRUE(waits);
  EXPECT_NE(a_.decoder->ReserveOrWait("w", "p", other, {}, {}, until, wrong.Done(), &waits), 0u);
  EXPECT_TRUE(waits);
  EXPECT_FALSE(right.Has());
  ASSERT_TRUE(
      a_.decoder->Register(ByReference("r", prompt), std::make_shared<RecordingSink>()).ok());
  ASSERT_TRUE(
      a_.decoder->Register(ByReference("w", prompt), std::make_shared<RecordingSink>()).ok());
  ASSERT_TRUE(WaitFor([&] { return right.Has() && wrong.Has(); }));
  EXPECT_TRUE(right.Get().ok()) << right.Get().status().ToString();
  EXPECT_EQ(wrong.Get().status().code(), StatusCode::kInvalidArgument)
      << wrong.Get().status().ToString();
  EXPECT_EQ(a_.decoder->counts().reservations, 1u);
  EXPECT_EQ(FreeBlocks(a_), 32u - 3u);  // "r"'s three blocks only
}

}  // namespace
}  // namespace tandem::worker_test
