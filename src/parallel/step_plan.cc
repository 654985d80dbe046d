#include "parallel/step_plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cstring>

namespace tandem::parallel {
namespace {

static_assert(std::endian::native == std::endian::little,
              "the step plan's wire format is little-endian; add byte swaps for this host");

constexpr uint32_t kMagic = 0x4C505354;  // "TSPL" read as little-endian bytes
constexpr uint16_t kVersion = 1;
constexpr uint16_t kTagChunks = 1;
constexpr uint16_t kTagMicroBatchEnds = 2;
constexpr size_t kHeaderBytes = 4 + 2 + 1 + 1 + 8 + 4;
constexpr size_t kFieldHeaderBytes = 2 + 2 + 4;

class Writer {
 public:
  template <class T>
  void Put(T v) {
    const auto* p = reinterpret_cast<const std::byte*>(&v);
    out_.insert(out_.end(), p, p + sizeof(T));
  }
  void PutU32s(std::span<const uint32_t> v) {
    const auto* p = reinterpret_cast<const std::byte*>(v.data());
    out_.insert(out_.end(), p, p + v.size_bytes());
  }
  void PutBytes(std::span<const std::byte> v) { out_.insert(out_.end(), v.begin(), v.end()); }
  // Starts a field; returns where its length goes (filled by EndField).
  size_t BeginField(uint16_t tag) {
    Put<uint16_t>(tag);
    Put<uint16_t>(0);
    const size_t at = out_.size();
    Put<uint32_t>(0);
    return at;
  }
  void EndField(size_t length_at) {
    const auto length = static_cast<uint32_t>(out_.size() - length_at - 4);
    std::memcpy(out_.data() + length_at, &length, 4);
  }
  std::vector<std::byte>& bytes() { return out_; }

 private:
  std::vector<std::byte> out_;
};

class Reader {
 public:
  Reader(std::span<const std::byte> in, const char* what) : in_(in), what_(what) {}
  template <class T>
  Result<T> Get() {
    if (in_.size() - at_ < sizeof(T)) return Truncated();
    T v;
    std::memcpy(&v, in_.data() + at_, sizeof(T));
    at_ += sizeof(T);
    return v;
  }
  Status GetU32s(size_t n, std::vector<uint32_t>* out) {
    if ((in_.size() - at_) / 4 < n) return Truncated();
    out->resize(n);
    if (n != 0) std::memcpy(out->data(), in_.data() + at_, n * 4);
    at_ += n * 4;
    return Status::Ok();
  }
  Result<std::span<const std::byte>> GetBytes(size_t n) {
    if (in_.size() - at_ < n) return Truncated();
    auto s = in_.subspan(at_, n);
    at_ += n;
    return s;
  }
  bool done() const { return at_ == in_.size(); }

 private:
  Status Truncated() const {
    return InvalidArgumentError(
        fmt::format("step plan: {} is truncated ({} bytes, offset {})", what_, in_.size(), at_));
  }
  std::span<const std::byte> in_;
  const char* what_;
  size_t at_ = 0;
};

Result<std::vector<PlanChunk>> ParseChunks(std::span<const std::byte> payload) {
  Reader r(payload, "the chunks field");
  TANDEM_ASSIGN_OR_RETURN(uint32_t count, r.Get<uint32_t>());
  // Each chunk takes at least 16 bytes: a count beyond that is corrupt.
  if (count > payload.size() / 16) {
    return InvalidArgumentError(fmt::format(
        "step plan: {} chunks cannot fit a {}-byte chunks field", count, payload.size()));
  }
  std::vector<PlanChunk> chunks(count);
  for (PlanChunk& c : chunks) {
    TANDEM_ASSIGN_OR_RETURN(c.start_pos, r.Get<uint32_t>());
    TANDEM_ASSIGN_OR_RETURN(c.num_logits, r.Get<uint32_t>());
    TANDEM_ASSIGN_OR_RETURN(uint32_t n_tokens, r.Get<uint32_t>());
    TANDEM_ASSIGN_OR_RETURN(uint32_t n_blocks, r.Get<uint32_t>());
    TANDEM_RETURN_IF_ERROR(r.GetU32s(n_tokens, &c.tokens));
    TANDEM_RETURN_IF_ERROR(r.GetU32s(n_blocks, &c.block_table));
  }
  if (!r.done()) return InvalidArgumentError("step plan: trailing bytes after the chunks");
  return chunks;
}

}  // namespace

const char* StepKindName(StepKind kind) {
  switch (kind) {
    case StepKind::kForward: return "forward";
    case StepKind::kPushKv: return "push_kv";
    case StepKind::kShutdown: return "shutdown";
  }
  return "unknown";
}

std::vector<std::byte> SerializeStepPlan(const StepPlan& plan) {
  Writer w;
  w.Put<uint32_t>(kMagic);
  w.Put<uint16_t>(kVersion);
  w.Put<uint8_t>(static_cast<uint8_t>(plan.kind));
  w.Put<uint8_t>(0);
  w.Put<uint64_t>(plan.step);
  const uint32_t fields = (plan.chunks.empty() ? 0u : 1u) +
                          (plan.micro_batch_ends.empty() ? 0u : 1u) +
                          static_cast<uint32_t>(plan.extensions.size());
  w.Put<uint32_t>(fields);
  if (!plan.chunks.empty()) {
    const size_t at = w.BeginField(kTagChunks);
    w.Put<uint32_t>(static_cast<uint32_t>(plan.chunks.size()));
    for (const PlanChunk& c : plan.chunks) {
      w.Put<uint32_t>(c.start_pos);
      w.Put<uint32_t>(c.num_logits);
      w.Put<uint32_t>(static_cast<uint32_t>(c.tokens.size()));
      w.Put<uint32_t>(static_cast<uint32_t>(c.block_table.size()));
      w.PutU32s(c.tokens);
      w.PutU32s(c.block_table);
    }
    w.EndField(at);
  }
  if (!plan.micro_batch_ends.empty()) {
    const size_t at = w.BeginField(kTagMicroBatchEnds);
    w.Put<uint32_t>(static_cast<uint32_t>(plan.micro_batch_ends.size()));
    w.PutU32s(plan.micro_batch_ends);
    w.EndField(at);
  }
  for (const PlanField& f : plan.extensions) {
    const size_t at = w.BeginField(f.tag);
    w.PutBytes(f.bytes);
    w.EndField(at);
  }
  return std::move(w.bytes());
}

Result<StepPlan> ParseStepPlan(std::span<const std::byte> bytes) {
  Reader r(bytes, "the header");
  if (bytes.size() < kHeaderBytes) {
    return InvalidArgumentError(fmt::format("step plan: {} bytes is shorter than its {}-byte header",
                                            bytes.size(), kHeaderBytes));
  }
  TANDEM_ASSIGN_OR_RETURN(uint32_t magic, r.Get<uint32_t>());
  if (magic != kMagic) {
    return InvalidArgumentError(fmt::format("step plan: bad magic {:#010x}", magic));
  }
  TANDEM_ASSIGN_OR_RETURN(uint16_t version, r.Get<uint16_t>());
  if (version != kVersion) {
    return InvalidArgumentError(fmt::format(
        "step plan: version {} (this build reads version {}); every rank must run the same build",
        version, kVersion));
  }
  TANDEM_ASSIGN_OR_RETURN(uint8_t kind, r.Get<uint8_t>());
  if (kind < static_cast<uint8_t>(StepKind::kForward) ||
      kind > static_cast<uint8_t>(StepKind::kShutdown)) {
    return InvalidArgumentError(fmt::format("step plan: unknown kind {}", kind));
  }
  TANDEM_ASSIGN_OR_RETURN(uint8_t reserved, r.Get<uint8_t>());
  (void)reserved;
  StepPlan plan;
  plan.kind = static_cast<StepKind>(kind);
  TANDEM_ASSIGN_OR_RETURN(plan.step, r.Get<uint64_t>());
  TANDEM_ASSIGN_OR_RETURN(uint32_t fields, r.Get<uint32_t>());
  if (fields > (bytes.size() - kHeaderBytes) / kFieldHeaderBytes) {
    return InvalidArgumentError(
        fmt::format("step plan: {} fields cannot fit {} bytes", fields, bytes.size()));
  }
  Reader fr(bytes.subspan(kHeaderBytes), "a field");
  for (uint32_t i = 0; i < fields; ++i) {
    TANDEM_ASSIGN_OR_RETURN(uint16_t tag, fr.Get<uint16_t>());
    TANDEM_ASSIGN_OR_RETURN(uint16_t pad, fr.Get<uint16_t>());
    (void)pad;
    TANDEM_ASSIGN_OR_RETURN(uint32_t length, fr.Get<uint32_t>());
    TANDEM_ASSIGN_OR_RETURN(auto payload, fr.GetBytes(length));
    if (tag == kTagChunks) {
      TANDEM_ASSIGN_OR_RETURN(plan.chunks, ParseChunks(payload));
    } else if (tag == kTagMicroBatchEnds) {
      Reader mr(payload, "the micro-batch field");
      TANDEM_ASSIGN_OR_RETURN(uint32_t count, mr.Get<uint32_t>());
      TANDEM_RETURN_IF_ERROR(mr.GetU32s(count, &plan.micro_batch_ends));
    } else if (tag >= kFirstExtensionTag) {
      plan.extensions.push_back(PlanField{tag, {payload.begin(), payload.end()}});
    } else {
      return InvalidArgumentError(fmt::format("step plan: unknown field tag {}", tag));
    }
  }
  if (!fr.done()) return InvalidArgumentError("step plan: trailing bytes after the fields");
  if (!plan.micro_batch_ends.empty()) {
    uint32_t prev = 0;
    for (uint32_t e : plan.micro_batch_ends) {
      if (e <= prev || e > plan.chunks.size()) {
        return InvalidArgumentError(fmt::format(
            "step plan: micro-batch end {} is not ascending within the {} chunks", e,
            plan.chunks.size()));
      }
      prev = e;
    }
    if (prev != plan.chunks.size()) {
      return InvalidArgumentError(fmt::format(
          "step plan: the micro-batches end at chunk {} of {}", prev, plan.chunks.size()));
    }
  }
  return plan;
}

std::vector<uint32_t> SplitMicroBatches(std::span<const uint32_t> tokens_per_chunk,
                                        uint32_t max_micro_batches) {
  const auto n = static_cast<uint32_t>(tokens_per_chunk.size());
  const uint32_t m = std::min(n, std::max(max_micro_batches, 1u));
  std::vector<uint32_t> ends;
  if (n == 0) return ends;
  uint64_t total = 0;
  for (uint32_t t : tokens_per_chunk) total += t;
  // Cut after the chunk where the running token count first reaches
  // k * total / m, leaving at least one chunk for every later micro-batch.
  uint64_t running = 0;
  for (uint32_t i = 0; i < n; ++i) {
    running += tokens_per_chunk[i];
    const auto k = static_cast<uint32_t>(ends.size()) + 1;  // the micro-batch being filled
    if (k == m) break;
    const uint32_t chunks_left = n - (i + 1);
    const uint32_t batches_left = m - k;
    if (chunks_left == batches_left || running * m >= total * k) ends.push_back(i + 1);
  }
  ends.push_back(n);
  return ends;
}

Status SendStepPlan(Communicator& world, const StepPlan& plan, int root) {
  const std::vector<std::byte> bytes = SerializeStepPlan(plan);
  std::vector<std::byte> inline_buf(kPlanInlineBytes);
  const uint64_t size = bytes.size();
  std::memcpy(inline_buf.data(), &size, sizeof(size));
  const size_t head = std::min(bytes.size(), kPlanInlineBytes - sizeof(size));
  std::memcpy(inline_buf.data() + sizeof(size), bytes.data(), head);
  TANDEM_RETURN_IF_ERROR(world.Broadcast(inline_buf, root));
  if (head < bytes.size()) {
    std::vector<std::byte> rest(bytes.begin() + static_cast<std::ptrdiff_t>(head), bytes.end());
    TANDEM_RETURN_IF_ERROR(world.Broadcast(rest, root));
  }
  return Status::Ok();
}

Result<StepPlan> ReceiveStepPlan(Communicator& world, int root) {
  std::vector<std::byte> inline_buf(kPlanInlineBytes);
  TANDEM_RETURN_IF_ERROR(world.Broadcast(inline_buf, root));
  uint64_t size = 0;
  std::memcpy(&size, inline_buf.data(), sizeof(size));
  // A plan is bounded by the step's tokens and block tables; 1 GiB means a
  // corrupt size, not a plan.
  if (size < kHeaderBytes || size > (uint64_t{1} << 30)) {
    return InvalidArgumentError(fmt::format("step plan: announced size {} bytes is invalid", size));
  }
  std::vector<std::byte> bytes(size);
  const size_t head = std::min<size_t>(size, kPlanInlineBytes - sizeof(size));
  std::memcpy(bytes.data(), inline_buf.data() + sizeof(size), head);
  if (head < size) {
    std::span<std::byte> rest(bytes.data() + head, size - head);
    TANDEM_RETURN_IF_ERROR(world.Broadcast(rest, root));
  }
  return ParseStepPlan(bytes);
}

}  // namespace tandem::parallel
