// InlineFunction<R(Args...)>: a copyable callable wrapper like
// std::function, for the per-token callbacks (issue 23, tok-chain): a
// callable of up to kInlineBytes is kept inside the wrapper whatever it
// captures. libstdc++'s std::function keeps only trivially copyable
// callables inline, so a lambda capturing a shared_ptr or a weak_ptr (16
// bytes) lives in a heap block of its own: one more cache line, read after
// the wrapper's, per call. Kept inline, the callable is on the wrapper's own
// lines, which the caller can prefetch with the object that holds it.
//
// A larger callable (or one whose move may throw) goes to the heap, as in
// std::function. Calling an empty InlineFunction is undefined (check it
// with operator bool first); a moved-from one is empty.
#pragma once

#include <cstddef>
#include <functional>
#include <new>
#include <type_traits>
#include <utility>

namespace tandem {

template <typename Sig, size_t kInlineBytes = 32>
class InlineFunction;

template <typename R, typename... Args, size_t kInlineBytes>
class InlineFunction<R(Args...), kInlineBytes> {
 public:
  InlineFunction() noexcept = default;
  InlineFunction(std::nullptr_t) noexcept {}  // NOLINT: as std::function
  template <typename F, typename D = std::decay_t<F>,
            typename = std::enable_if_t<!std::is_same_v<D, InlineFunction> &&
                                        std::is_invocable_r_v<R, D&, Args...>>>
  InlineFunction(F&& f) {  // NOLINT: implicit, as std::function
    static_assert(std::is_copy_constructible_v<D>, "InlineFunction needs a copyable callable");
    if constexpr (std::is_pointer_v<D> || std::is_member_pointer_v<D>) {
      if (f == nullptr) return;  // a null function pointer makes an empty wrapper
    }
    if constexpr (kFitsInline<D>) {
      ::new (static_cast<void*>(buf_)) D(std::forward<F>(f));
      ops_ = &kLocalOps<D>;
    } else {
      *reinterpret_cast<D**>(buf_) = new D(std::forward<F>(f));
      ops_ = &kHeapOps<D>;
    }
    invoke_ = ops_->invoke;
  }

  InlineFunction(const InlineFunction& o) {
    if (o.ops_ != nullptr) o.ops_->copy(o.buf_, buf_);
    invoke_ = o.invoke_;
    ops_ = o.ops_;
  }
  InlineFunction(InlineFunction&& o) noexcept : invoke_(o.invoke_), ops_(o.ops_) {
    if (ops_ != nullptr) ops_->move(o.buf_, buf_);
    o.invoke_ = nullptr;
    o.ops_ = nullptr;
  }
  InlineFunction& operator=(const InlineFunction& o) {
    if (this != &o) {
      InlineFunction copy(o);
      *this = std::move(copy);
    }
    return *this;
  }
  InlineFunction& operator=(InlineFunction&& o) noexcept {
    if (this != &o) {
      Reset();
      invoke_ = o.invoke_;
      ops_ = o.ops_;
      if (ops_ != nullptr) ops_->move(o.buf_, buf_);
      o.invoke_ = nullptr;
      o.ops_ = nullptr;
    }
    return *this;
  }
  InlineFunction& operator=(std::nullptr_t) noexcept {
    Reset();
    return *this;
  }
  template <typename F, typename D = std::decay_t<F>,
            typename = std::enable_if_t<!std::is_same_v<D, InlineFunction> &&
                                        std::is_invocable_r_v<R, D&, Args...>>>
  InlineFunction& operator=(F&& f) {
    *this = InlineFunction(std::forward<F>(f));
    return *this;
  }
  ~InlineFunction() { Reset(); }

  explicit operator bool() const noexcept { return invoke_ != nullptr; }

  R operator()(Args... args) const {
    return invoke_(const_cast<unsigned char*>(buf_), std::forward<Args>(args)...);
  }

  // Whether a callable of type D is kept inside the wrapper (no heap block).
  template <typename D>
  static constexpr bool kFitsInline = sizeof(D) <= kInlineBytes &&
                                      alignof(D) <= alignof(std::max_align_t) &&
                                      std::is_nothrow_move_constructible_v<D>;

 private:
  struct Ops {
    R (*invoke)(void* buf, Args&&... args);
    void (*copy)(const void* from, void* to);
    void (*move)(void* from, void* to) noexcept;  // leaves `from` destroyed
    void (*destroy)(void* buf) noexcept;
  };

  template <typename D>
  static D* Local(void* buf) {
    return std::launder(reinterpret_cast<D*>(buf));
  }
  template <typename D>
  static D*& Heap(void* buf) {
    return *reinterpret_cast<D**>(buf);
  }
  template <typename D>
  static D* const& Heap(const void* buf) {
    return *reinterpret_cast<D* const*>(buf);
  }

  template <typename D>
  static constexpr Ops kLocalOps = {
      [](void* buf, Args&&... args) -> R {
        return std::invoke(*Local<D>(buf), std::forward<Args>(args)...);
      },
      [](const void* from, void* to) {
        ::new (to) D(*Local<D>(const_cast<void*>(from)));
      },
      [](void* from, void* to) noexcept {
        D* f = Local<D>(from);
        ::new (to) D(std::move(*f));
        f->~D();
      },
      [](void* buf) noexcept { Local<D>(buf)->~D(); },
  };
  template <typename D>
  static constexpr Ops kHeapOps = {
      [](void* buf, Args&&... args) -> R {
        return std::invoke(*Heap<D>(buf), std::forward<Args>(args)...);
      },
      [](const void* from, void* to) { Heap<D>(to) = new D(*Heap<D>(from)); },
      [](void* from, void* to) noexcept {
        Heap<D>(to) = Heap<D>(from);
        Heap<D>(from) = nullptr;
      },
      [](void* buf) noexcept { delete Heap<D>(buf); },
  };

  void Reset() noexcept {
    if (ops_ != nullptr) ops_->destroy(buf_);
    invoke_ = nullptr;
    ops_ = nullptr;
  }

  // The callable first, then its invoker (a call reads nothing else): a
  // caller that prefetches the wrapper gets the callable with it.
  alignas(std::max_align_t) unsigned char buf_[kInlineBytes];
  R (*invoke_)(void* buf, Args&&... args) = nullptr;
  const Ops* ops_ = nullptr;  // copy, move, destroy
};

}  // namespace tandem
