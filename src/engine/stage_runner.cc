#include "engine/stage_runner.h"

#include <fmt/format.h>

namespace tandem::engine {
namespace {

std::span<std::byte> AsBytes(std::span<float> v) {
  return {reinterpret_cast<std::byte*>(v.data()), v.size_bytes()};
}
std::span<const std::byte> AsBytes(std::span<const float> v) {
  return {reinterpret_cast<const std::byte*>(v.data()), v.size_bytes()};
}

}  // namespace

Result<RankComms> JoinRankComms(const parallel::ParallelLayout& layout, uint32_t rank,
                                const std::string& group, int64_t join_timeout_ms) {
  RankComms c;
  const uint32_t stage = layout.stage_of(rank), tp_rank = layout.tp_rank_of(rank);
  auto join = [&](const std::string& name, uint32_t r, uint32_t size)
      -> Result<std::unique_ptr<parallel::Communicator>> {
    // The world group carries only the step plans (a few KiB).
    const size_t max_bytes = name == group + "-world" ? (size_t{1} << 20) : (size_t{8} << 20);
    auto comm = parallel::CreateShmCommunicator(name, static_cast<int>(r), static_cast<int>(size),
                                                join_timeout_ms, max_bytes);
    if (!comm.ok()) {
      return comm.status().WithContext(
          fmt::format("rank {} of {} joining communicator '{}'", rank, layout.world(), name));
    }
    return std::move(comm).value();
  };
  TANDEM_ASSIGN_OR_RETURN(c.world, join(group + "-world", rank, layout.world()));
  if (layout.tp > 1) {
    TANDEM_ASSIGN_OR_RETURN(c.tp, join(fmt::format("{}-tp{}", group, stage), tp_rank, layout.tp));
  }
  if (layout.pp > 1) {
    TANDEM_ASSIGN_OR_RETURN(c.pp, join(fmt::format("{}-pp{}", group, tp_rank), stage, layout.pp));
  }
  return c;
}

StageRunner::StageRunner(const parallel::ParallelLayout& layout, uint32_t rank,
                         LlamaForward* model, const KvPool* pool, RankComms* comms,
                         kernels::cpu::ThreadPool* threads)
    : layout_(layout),
      rank_(rank),
      stage_(layout.stage_of(rank)),
      tp_rank_(layout.tp_rank_of(rank)),
      model_(model),
      pool_(pool),
      comms_(comms),
      threads_(threads) {}

// The communicators name their own members; say which ranks those are.
Status StageRunner::TpContext(Status st) const {
  if (st.ok() || layout_.tp == 1) return st;
  return st.WithContext(fmt::format(
      "rank {}: the tensor-parallel group of stage {} (members 0..{} are ranks {}..{})", rank_,
      stage_, layout_.tp - 1, layout_.rank_of(stage_, 0), layout_.rank_of(stage_, layout_.tp - 1)));
}

Status StageRunner::RecvLogits(std::span<float> logits, size_t row_begin, size_t rows) {
  if (rows == 0) return Status::Ok();
  const size_t vocab = model_->config().vocab_size;
  const int last = static_cast<int>(layout_.pp - 1);
  Status st = comms_->pp->Recv(AsBytes(logits.subspan(row_begin * vocab, rows * vocab)), last);
  if (!st.ok()) {
    return st.WithContext(fmt::format(
        "rank 0 receiving logits from rank {} (stage {}: member {} of the pipeline group)",
        layout_.rank_of(layout_.pp - 1, 0), last, last));
  }
  return Status::Ok();
}

Status StageRunner::Run(std::span<const SeqChunk> batch, std::span<const uint32_t> mb_ends,
                        std::span<float> logits,
                        const std::function<void(uint32_t)>& on_layer_done) {
  parallel::Communicator* tp = comms_->tp.get();
  if (layout_.pp == 1) {
    StageIo io;
    if (tp_rank_ == 0) io.logits = logits;
    return TpContext(model_->ForwardStage(batch, *pool_, io, tp, threads_, on_layer_done));
  }
  const size_t hidden = model_->config().hidden_size, vocab = model_->config().vocab_size;
  const bool first = stage_ == 0, last = stage_ + 1 == layout_.pp;
  const bool rank0 = rank_ == 0;
  const std::vector<uint32_t> whole{static_cast<uint32_t>(batch.size())};
  if (mb_ends.empty()) mb_ends = whole;
  const size_t num_mb = mb_ends.size();
  // Logit rows of each micro-batch in `logits` (rank 0).
  std::vector<size_t> row_begin(num_mb + 1, 0);
  size_t begin = 0;
  for (size_t i = 0; i < num_mb; ++i) {
    size_t rows = 0;
    for (size_t c = begin; c < mb_ends[i]; ++c) rows += batch[c].num_logits;
    row_begin[i + 1] = row_begin[i] + rows;
    begin = mb_ends[i];
  }
  const int prev = static_cast<int>(stage_) - 1, next = static_cast<int>(stage_) + 1;
  size_t logits_received = 0;
  begin = 0;
  for (size_t i = 0; i < num_mb; ++i) {
    const auto mb = batch.subspan(begin, mb_ends[i] - begin);
    begin = mb_ends[i];
    size_t tokens = 0;
    for (const SeqChunk& s : mb) tokens += s.tokens.size();
    const size_t rows = row_begin[i + 1] - row_begin[i];
    StageIo io;
    if (!first) {
      if (hidden_in_.size() < tokens * hidden) hidden_in_.resize(tokens * hidden);
      std::span<float> in(hidden_in_.data(), tokens * hidden);
      Status st = comms_->pp->Recv(AsBytes(in), prev);
      if (!st.ok()) {
        return st.WithContext(fmt::format(
            "rank {} receiving activations from rank {} (member {} of the pipeline group)", rank_,
            layout_.rank_of(stage_ - 1, tp_rank_), prev));
      }
      io.hidden_in = in;
    }
    if (!last) {
      if (hidden_out_.size() < tokens * hidden) hidden_out_.resize(tokens * hidden);
      io.hidden_out = std::span<float>(hidden_out_.data(), tokens * hidden);
    } else if (tp_rank_ == 0) {
      if (logits_.size() < rows * vocab) logits_.resize(rows * vocab);
      io.logits = std::span<float>(logits_.data(), rows * vocab);
    }
    TANDEM_RETURN_IF_ERROR(TpContext(model_->ForwardStage(mb, *pool_, io, tp, threads_, {})));
    if (rank0 && i + 1 >= layout_.pp) {
      // Keep the schedule rendezvous-safe (see the header).
      const size_t j = i + 1 - layout_.pp;
      TANDEM_RETURN_IF_ERROR(RecvLogits(logits, row_begin[j], row_begin[j + 1] - row_begin[j]));
      logits_received = j + 1;
    }
    if (!last) {
      Status st = comms_->pp->Send(AsBytes(std::span<const float>(io.hidden_out)), next);
      if (!st.ok()) {
        return st.WithContext(fmt::format(
            "rank {} sending activations to rank {} (member {} of the pipeline group)", rank_,
            layout_.rank_of(stage_ + 1, tp_rank_), next));
      }
    } else if (tp_rank_ == 0 && rows != 0) {
      Status st = comms_->pp->Send(AsBytes(std::span<const float>(io.logits)), 0);
      if (!st.ok()) {
        return st.WithContext(
            fmt::format("rank {} sending logits to rank 0 (member 0 of the pipeline group)", rank_));
      }
    }
  }
  if (rank0) {
    for (size_t j = logits_received; j < num_mb; ++j) {
      TANDEM_RETURN_IF_ERROR(RecvLogits(logits, row_begin[j], row_begin[j + 1] - row_begin[j]));
    }
  }
  return Status::Ok();
}

}  // namespace tandem::engine
