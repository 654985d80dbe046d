#include "kvtransfer/slice_push.h"

#include <fmt/format.h>

#include <condition_variable>
#include <cstring>
#include <memory>

namespace tandem::kvtransfer {
namespace {

constexpr char kMagic[4] = {'T', 'K', 'S', 'P'};
constexpr uint32_t kVersion = 1;
// Bounds on decoded sizes (a corrupt message must not allocate gigabytes).
constexpr uint32_t kMaxRanks = 4096;
constexpr uint32_t kMaxBlocks = 1u << 24;
constexpr uint32_t kMaxString = 1u << 20;

void PutU32(std::string& out, uint32_t v) {
  char b[4];
  for (int i = 0; i < 4; ++i) b[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  out.append(b, 4);
}
void PutStr(std::string& out, std::string_view s) {
  PutU32(out, static_cast<uint32_t>(s.size()));
  out.append(s);
}

class Reader {
 public:
  explicit Reader(std::string_view in) : in_(in) {}
  Result<uint32_t> U32(const char* what) {
    if (in_.size() < 4) return Truncated(what);
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v |= uint32_t{static_cast<uint8_t>(in_[i])} << (8 * i);
    in_.remove_prefix(4);
    return v;
  }
  Result<std::string> Str(const char* what) {
    TANDEM_ASSIGN_OR_RETURN(uint32_t n, U32(what));
    if (n > kMaxString) {
      return InvalidArgumentError(
          fmt::format("slice push spec: {} of {} bytes exceeds {}", what, n, kMaxString));
    }
    if (in_.size() < n) return Truncated(what);
    std::string s(in_.substr(0, n));
    in_.remove_prefix(n);
    return s;
  }
  Result<std::vector<uint32_t>> U32s(const char* what) {
    TANDEM_ASSIGN_OR_RETURN(uint32_t n, U32(what));
    if (n > kMaxBlocks) {
      return InvalidArgumentError(
          fmt::format("slice push spec: {} entries of {} exceed {}", n, what, kMaxBlocks));
    }
    if (in_.size() / 4 < n) return Truncated(what);
    std::vector<uint32_t> v(n);
    for (uint32_t i = 0; i < n; ++i) {
      TANDEM_ASSIGN_OR_RETURN(v[i], U32(what));
    }
    return v;
  }
  bool empty() const { return in_.empty(); }

 private:
  static Status Truncated(const char* what) {
    return InvalidArgumentError(fmt::format("slice push spec truncated at {}", what));
  }
  std::string_view in_;
};

}  // namespace

std::string SlicePushSpec::Encode() const {
  std::string out(kMagic, 4);
  PutU32(out, kVersion);
  PutStr(out, request_id);
  for (uint32_t v : {prefill.tp, prefill.pp, decode.tp, decode.pp, dims.num_layers,
                     dims.num_kv_heads, dims.head_dim, dims.block_size, dims.bytes_per_elem}) {
    PutU32(out, v);
  }
  PutU32(out, static_cast<uint32_t>(decode_descriptors.size()));
  for (const auto& d : decode_descriptors) PutStr(out, d);
  for (const auto* v : {&block_ids, &slots}) {
    PutU32(out, static_cast<uint32_t>(v->size()));
    for (uint32_t x : *v) PutU32(out, x);
  }
  PutU32(out, cached_blocks);
  return out;
}

Result<SlicePushSpec> SlicePushSpec::Decode(std::string_view bytes) {
  if (bytes.size() < 4 || std::memcmp(bytes.data(), kMagic, 4) != 0) {
    return InvalidArgumentError("slice push spec: bad magic (not a TKSP message)");
  }
  Reader r(bytes.substr(4));
  TANDEM_ASSIGN_OR_RETURN(uint32_t version, r.U32("version"));
  if (version != kVersion) {
    return InvalidArgumentError(
        fmt::format("slice push spec: version {} (this build reads {})", version, kVersion));
  }
  SlicePushSpec s;
  TANDEM_ASSIGN_OR_RETURN(s.request_id, r.Str("request_id"));
  for (uint32_t* v :
       {&s.prefill.tp, &s.prefill.pp, &s.decode.tp, &s.decode.pp, &s.dims.num_layers,
        &s.dims.num_kv_heads, &s.dims.head_dim, &s.dims.block_size, &s.dims.bytes_per_elem}) {
    TANDEM_ASSIGN_OR_RETURN(*v, r.U32("layout and dims"));
  }
  TANDEM_ASSIGN_OR_RETURN(uint32_t n, r.U32("decode_descriptors"));
  if (n > kMaxRanks) {
    return InvalidArgumentError(
        fmt::format("slice push spec: {} decode descriptors exceed {}", n, kMaxRanks));
  }
  for (uint32_t i = 0; i < n; ++i) {
    TANDEM_ASSIGN_OR_RETURN(std::string d, r.Str("decode_descriptors"));
    s.decode_descriptors.push_back(std::move(d));
  }
  TANDEM_ASSIGN_OR_RETURN(s.block_ids, r.U32s("block_ids"));
  TANDEM_ASSIGN_OR_RETURN(s.slots, r.U32s("slots"));
  TANDEM_ASSIGN_OR_RETURN(s.cached_blocks, r.U32("cached_blocks"));
  if (!r.empty()) return InvalidArgumentError("slice push spec: trailing bytes");
  TANDEM_RETURN_IF_ERROR(s.Validate());
  return s;
}

Status SlicePushSpec::Validate() const {
  if (decode_descriptors.size() != decode.world()) {
    return InvalidArgumentError(fmt::format(
        "request '{}': {} decode rank descriptors for decode layout {} ({} ranks)", request_id,
        decode_descriptors.size(), parallel::ToString(decode), decode.world()));
  }
  if (block_ids.size() != slots.size()) {
    return InvalidArgumentError(fmt::format("request '{}': {} block ids for {} slots", request_id,
                                            block_ids.size(), slots.size()));
  }
  if (cached_blocks > slots.size()) {
    return InvalidArgumentError(fmt::format("request '{}': cached_blocks {} of {} blocks",
                                            request_id, cached_blocks, slots.size()));
  }
  return parallel::PlanKvSlices(prefill, decode, dims).status();
}

std::vector<Segment> SliceSegments(const parallel::KvRankPairPlan& pair,
                                   std::span<const uint32_t> block_ids,
                                   std::span<const uint32_t> slots, uint32_t cached_blocks,
                                   uint64_t src_block_bytes, uint64_t dst_block_bytes) {
  std::vector<Segment> segs;
  const size_t n = std::min(block_ids.size(), slots.size());
  for (size_t b = cached_blocks; b < n; ++b) {
    for (const auto& run : pair.runs) {
      const Segment s{
          .local_offset_bytes = uint64_t{block_ids[b]} * src_block_bytes + run.src_offset_bytes,
          .remote_offset_bytes = uint64_t{slots[b]} * dst_block_bytes + run.dst_offset_bytes,
          .length_bytes = run.bytes};
      if (!segs.empty() &&
          segs.back().local_offset_bytes + segs.back().length_bytes == s.local_offset_bytes &&
          segs.back().remote_offset_bytes + segs.back().length_bytes == s.remote_offset_bytes) {
        segs.back().length_bytes += s.length_bytes;
      } else {
        segs.push_back(s);
      }
    }
  }
  return segs;
}

Result<PeerId> RankSlicePusher::PeerFor(const std::string& descriptor) {
  {
    std::lock_guard lock(mu_);
    if (auto it = peers_.find(descriptor); it != peers_.end()) return it->second;
  }
  TANDEM_ASSIGN_OR_RETURN(PeerId peer, transport_.ImportPeer(descriptor));
  std::lock_guard lock(mu_);
  peers_[descriptor] = peer;
  return peer;
}

std::vector<XferId> RankSlicePusher::Push(const SlicePushSpec& spec, Done done) {
  auto fail = [&](Status s) {
    done(Outcome{.status = std::move(s), .bytes = 0, .writes = 0});
    return std::vector<XferId>{};
  };
  if (Status v = spec.Validate(); !v.ok()) return fail(v);
  auto plan = parallel::PlanKvSlices(spec.prefill, spec.decode, spec.dims);
  if (!plan.ok()) return fail(plan.status());
  if (rank_ >= spec.prefill.world()) {
    return fail(InvalidArgumentError(fmt::format("prefill rank {} is outside layout {}", rank_,
                                                 parallel::ToString(spec.prefill))));
  }
  const uint64_t src_bytes = parallel::RankKvShapeOf(spec.prefill, spec.dims, rank_).block_bytes();
  if (src_bytes != transport_.block_bytes()) {
    return fail(FailedPreconditionError(
        fmt::format("prefill rank {} of {}: its pool's blocks are {} bytes, the slice plan's {}",
                    rank_, parallel::ToString(spec.prefill), transport_.block_bytes(), src_bytes)));
  }
  // Prepare every write first, so that a bad descriptor posts nothing.
  struct Write {
    XferId id;
    uint32_t dst;
    uint64_t bytes;
  };
  std::vector<Write> writes;
  Status bad;
  for (const parallel::KvRankPairPlan* pair : plan->FromRank(rank_)) {
    const uint64_t dst_bytes =
        parallel::RankKvShapeOf(spec.decode, spec.dims, pair->dst_rank).block_bytes();
    std::vector<Segment> segs =
        SliceSegments(*pair, spec.block_ids, spec.slots, spec.cached_blocks, src_bytes, dst_bytes);
    if (segs.empty()) continue;
    uint64_t bytes = 0;
    for (const auto& s : segs) bytes += s.length_bytes;
    auto peer = PeerFor(spec.decode_descriptors[pair->dst_rank]);
    if (!peer.ok()) {
      bad = peer.status().WithContext(
          fmt::format("request '{}': decode rank {}", spec.request_id, pair->dst_rank));
      break;
    }
    auto x = transport_.PrepareWrite(*peer, std::move(segs), std::nullopt);
    if (!x.ok()) {
      bad = x.status().WithContext(
          fmt::format("request '{}': preparing the slices for decode rank {}", spec.request_id,
                      pair->dst_rank));
      break;
    }
    writes.push_back({*x, pair->dst_rank, bytes});
  }
  if (!bad.ok()) {
    for (const Write& w : writes) transport_.Release(w.id).IgnoreError();
    return fail(bad);
  }
  if (writes.empty()) {
    done(Outcome{});
    return {};
  }

  struct Shared {
    std::mutex mu;
    size_t left;
    Outcome out;
    Done done;
  };
  auto shared = std::make_shared<Shared>();
  shared->left = writes.size();
  shared->done = std::move(done);
  for (const Write& w : writes) {
    shared->out.bytes += w.bytes;
    ++shared->out.writes;
  }
  {
    std::lock_guard lock(mu_);
    for (const Write& w : writes) inflight_[w.id] = true;
  }
  const std::string rid = spec.request_id;
  for (const Write& w : writes) {
    auto on_done = [this, shared, dst = w.dst, rid](XferId id, XferStatus st,
                                                    const Status& detail) {
      transport_.Release(id).IgnoreError();
      {
        std::lock_guard lock(mu_);
        inflight_.erase(id);
      }
      Done to_call;
      Outcome out;
      {
        std::lock_guard lock(shared->mu);
        if (st != XferStatus::kSuccess && shared->out.status.ok()) {
          shared->out.status = Status(
              StatusCode::kUnavailable,
              fmt::format("request '{}': KV slices from prefill rank {} to decode rank {}: {}{}",
                          rid, rank_, dst, XferStatusName(st),
                          detail.ok() ? "" : ": " + detail.message()));
        }
        if (--shared->left == 0) {
          to_call = std::move(shared->done);
          out = shared->out;
        }
      }
      if (to_call) to_call(std::move(out));
    };
    if (Status posted = transport_.Post(w.id, on_done); !posted.ok()) {
      // Not posted: it never calls back; count it as failed here.
      on_done(w.id, XferStatus::kErrBackend, posted);
    }
  }
  std::vector<XferId> ids;
  for (const Write& w : writes) ids.push_back(w.id);
  return ids;
}

RankSlicePusher::Outcome RankSlicePusher::PushAndWait(const SlicePushSpec& spec) {
  std::mutex mu;
  std::condition_variable cv;
  bool finished = false;
  Outcome result;
  Push(spec, [&](Outcome o) {
    std::lock_guard lock(mu);
    result = std::move(o);
    finished = true;
    cv.notify_all();
  });
  std::unique_lock lock(mu);
  cv.wait(lock, [&] { return finished; });
  return result;
}

void RankSlicePusher::AbortAll() {
  std::vector<XferId> ids;
  {
    std::lock_guard lock(mu_);
    for (const auto& [id, _] : inflight_) ids.push_back(id);
  }
  for (XferId id : ids) transport_.Abort(id).IgnoreError();
}

}  // namespace tandem::kvtransfer
