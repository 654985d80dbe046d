#include "worker/rank_kv.h"

#include <fmt/format.h>

#include <cstdint>

#include "kvtransfer/slice_push_ranks.h"

namespace tandem::worker {
namespace {

// The rank's KvPool is the transport's (UCX-registered) memory.
class RankPoolAllocator final : public engine::KvPoolAllocator {
 public:
  explicit RankPoolAllocator(kvtransfer::Transport& t) : transport_(t) {}
  Result<std::span<std::byte>> Allocate(size_t bytes) override {
    if (bytes != transport_.pool_bytes()) {
      return InternalError(
          fmt::format("the rank's KV pool wants {} bytes; its transport registered {}", bytes,
                      transport_.pool_bytes()));
    }
    if (reinterpret_cast<uintptr_t>(transport_.pool()) % 64 != 0) {
      return InternalError("the transport's KV pool is not 64-byte aligned");
    }
    return std::span<std::byte>(transport_.pool(), bytes);
  }

 private:
  kvtransfer::Transport& transport_;
};

}  // namespace

parallel::KvDims KvDimsOf(const model::ModelConfig& c, uint32_t block_size) {
  return {.num_layers = c.num_hidden_layers,
          .num_kv_heads = c.num_key_value_heads,
          .head_dim = c.head_dim,
          .block_size = block_size,
          .bytes_per_elem = sizeof(float)};
}

Status CheckTransportForLayout(const std::string& role, const parallel::ParallelLayout& layout,
                               const TransportConfig& transport) {
  if (layout.world() <= 1) return Status::Ok();
  const char* key = transport.encrypt    ? "transport.encrypt"
                    : transport.checksum ? "transport.checksum"
                                         : nullptr;
  if (key == nullptr) return Status::Ok();
  return FailedPreconditionError(fmt::format(
      "{} is on, but {}.tensor_parallel {} x {}.pipeline_parallel {} splits every KV block over "
      "{} ranks: no rank holds a whole block to {} (docs/parallelism.md); set {}: false",
      key, role, layout.tp, role, layout.pp, layout.world(),
      transport.encrypt ? "seal" : "checksum", key));
}

Result<std::unique_ptr<FollowerRankKv>> FollowerRankKv::Create(
    kvtransfer::TransportOptions base, const parallel::ParallelLayout& layout,
    const parallel::KvDims& dims, uint32_t rank) {
  if (rank == 0 || rank >= layout.world()) {
    return InvalidArgumentError(fmt::format("follower rank {} is outside {} ({} ranks)", rank,
                                            parallel::ToString(layout), layout.world()));
  }
  TANDEM_ASSIGN_OR_RETURN(parallel::KvSlicePlan plan, parallel::PlanKvSlices(layout, layout, dims));
  (void)plan;  // the layout can split the KV
  auto kv = std::unique_ptr<FollowerRankKv>(new FollowerRankKv());
  kv->rank_ = rank;
  base.agent_name = fmt::format("{}-rank{}", base.agent_name, rank);
  base.block_bytes = parallel::RankKvShapeOf(layout, dims, rank).block_bytes();
  base.staging_blocks = 0;  // no sealing with ranks (CheckTransportForLayout)
  TANDEM_ASSIGN_OR_RETURN(kv->transport_, kvtransfer::CreateTransport(base));
  kv->allocator_ = std::make_unique<RankPoolAllocator>(*kv->transport_);
  kv->pusher_ = std::make_unique<kvtransfer::RankSlicePusher>(*kv->transport_, rank);
  return kv;
}

FollowerRankKv::~FollowerRankKv() = default;

Status FollowerRankKv::OnJoined(parallel::Communicator& world) {
  return kvtransfer::ExchangeRankDescriptors(world, transport_->LocalDescriptor())
      .status()
      .WithContext(fmt::format("rank {} handing rank 0 its KV transport descriptor", rank_));
}

Status FollowerRankKv::OnPushKv(std::span<const std::byte> spec, parallel::Communicator& world) {
  return kvtransfer::RunFollowerPush(spec, *pusher_, world);
}

}  // namespace tandem::worker
