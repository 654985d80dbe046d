#include "common/inline_function.h"

#include <gtest/gtest.h>

#include <array>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace tandem {
namespace {

using TokenFn = InlineFunction<void(uint32_t, std::span<const uint32_t>)>;

// The per-token callbacks' captures (lifecycle: weak_ptr + attempt; h2:
// shared_ptr) are kept inside the wrapper: no heap block of their own.
TEST(InlineFunctionTest, SmartPointerCapturesAreInline) {
  auto owner = std::make_shared<int>(7);
  std::weak_ptr<int> weak = owner;
  uint32_t attempt = 3;
  auto launch_like = [weak, attempt](uint32_t, std::span<const uint32_t>) { (void)attempt; };
  auto h2_like = [owner](uint32_t, std::span<const uint32_t>) {};
  EXPECT_TRUE(TokenFn::kFitsInline<decltype(launch_like)>);
  EXPECT_TRUE(TokenFn::kFitsInline<decltype(h2_like)>);
  struct Big {
    std::array<char, 64> bytes{};
    void operator()(uint32_t, std::span<const uint32_t>) const {}
  };
  EXPECT_FALSE(TokenFn::kFitsInline<Big>);
}

TEST(InlineFunctionTest, CallsWithArgumentsAndReturns) {
  std::vector<uint32_t> seen;
  uint32_t first = 0;
  TokenFn f = [&seen, &first](uint32_t idx, std::span<const uint32_t> ids) {
    first = idx;
    seen.assign(ids.begin(), ids.end());
  };
  ASSERT_TRUE(f);
  const std::vector<uint32_t> ids = {4, 5, 6};
  f(9, ids);
  EXPECT_EQ(first, 9u);
  EXPECT_EQ(seen, ids);

  InlineFunction<int(int)> twice = [](int v) { return 2 * v; };
  EXPECT_EQ(twice(21), 42);
  InlineFunction<std::string(std::string)> moved = [](std::string s) { return s + "!"; };
  EXPECT_EQ(moved("hi"), "hi!");
}

TEST(InlineFunctionTest, EmptyNullAndMovedFrom) {
  TokenFn empty;
  EXPECT_FALSE(empty);
  TokenFn null = nullptr;
  EXPECT_FALSE(null);
  void (*no_fn)(uint32_t, std::span<const uint32_t>) = nullptr;
  TokenFn from_null_pointer = no_fn;
  EXPECT_FALSE(from_null_pointer);

  int calls = 0;
  TokenFn a = [&calls](uint32_t, std::span<const uint32_t>) { ++calls; };
  TokenFn b = std::move(a);
  EXPECT_FALSE(a);  // NOLINT(bugprone-use-after-move): moved-from is empty
  ASSERT_TRUE(b);
  b(0, {});
  EXPECT_EQ(calls, 1);
  b = nullptr;
  EXPECT_FALSE(b);
}

// Captures are copied, moved and destroyed exactly as the callable's own
// copy, move and destructor say, inline and on the heap alike.
template <size_t kPad>
struct Counted {
  std::shared_ptr<int> token;
  std::array<char, kPad> pad{};
  int operator()(int v) const { return v + *token; }
};

template <size_t kPad>
void CheckOwnership() {
  auto token = std::make_shared<int>(1);
  {
    InlineFunction<int(int)> f = Counted<kPad>{token};
    EXPECT_EQ(token.use_count(), 2);
    InlineFunction<int(int)> copy = f;
    EXPECT_EQ(token.use_count(), 3);
    EXPECT_EQ(copy(1), 2);
    InlineFunction<int(int)> moved = std::move(f);
    EXPECT_EQ(token.use_count(), 3);
    EXPECT_EQ(moved(2), 3);
    copy = moved;  // copy-assign over a live callable
    EXPECT_EQ(token.use_count(), 3);
    moved = InlineFunction<int(int)>();  // move-assign an empty one
    EXPECT_EQ(token.use_count(), 2);
    copy = [](int v) { return v; };  // assign a new callable
    EXPECT_EQ(token.use_count(), 1);
    EXPECT_EQ(copy(5), 5);
    InlineFunction<int(int)> again = Counted<kPad>{token};
    auto& alias = again;
    again = alias;  // self-assignment keeps it
    EXPECT_EQ(again(1), 2);
    EXPECT_EQ(token.use_count(), 2);
  }
  EXPECT_EQ(token.use_count(), 1);
}

TEST(InlineFunctionTest, OwnershipInline) {
  static_assert(InlineFunction<int(int)>::kFitsInline<Counted<8>>);
  CheckOwnership<8>();
}

TEST(InlineFunctionTest, OwnershipOnTheHeap) {
  static_assert(!InlineFunction<int(int)>::kFitsInline<Counted<100>>);
  CheckOwnership<100>();
}

// A mutable callable keeps its state between calls (std::function's rule:
// the const wrapper calls it as a non-const lvalue).
TEST(InlineFunctionTest, MutableState) {
  InlineFunction<int()> counter = [n = 0]() mutable { return ++n; };
  EXPECT_EQ(counter(), 1);
  EXPECT_EQ(counter(), 2);
  InlineFunction<int()> copy = counter;
  EXPECT_EQ(copy(), 3);
  EXPECT_EQ(counter(), 3);
}

// A std::function converts (it is a callable like any other).
TEST(InlineFunctionTest, FromStdFunction) {
  std::function<int(int)> sf = [](int v) { return v * 3; };
  InlineFunction<int(int)> f = sf;
  EXPECT_EQ(f(3), 9);
}

}  // namespace
}  // namespace tandem
