#include "parallel/parallel_layout.h"

#include <fmt/format.h>

namespace tandem::parallel {

Status CheckLayout(const ParallelLayout& l, const ModelDims& d) {
  if (l.tp < 1 || l.pp < 1) {
    return InvalidArgumentError(
        fmt::format("tensor_parallel {} and pipeline_parallel {} must be at least 1", l.tp, l.pp));
  }
  auto divides = [&](uint32_t n, const char* what) -> Status {
    if (n % l.tp != 0) {
      return InvalidArgumentError(
          fmt::format("tensor_parallel {} does not divide {} {}", l.tp, what, n));
    }
    return Status::Ok();
  };
  TANDEM_RETURN_IF_ERROR(divides(d.num_heads, "num_attention_heads"));
  TANDEM_RETURN_IF_ERROR(divides(d.intermediate, "intermediate_size"));
  TANDEM_RETURN_IF_ERROR(divides(d.vocab, "vocab_size"));
  if (d.num_kv_heads == 0 || (d.num_kv_heads % l.tp != 0 && l.tp % d.num_kv_heads != 0)) {
    return InvalidArgumentError(fmt::format(
        "tensor_parallel {} neither divides nor is a multiple of num_key_value_heads {}", l.tp,
        d.num_kv_heads));
  }
  if (l.pp > d.num_layers) {
    return InvalidArgumentError(fmt::format(
        "pipeline_parallel {} exceeds num_hidden_layers {}", l.pp, d.num_layers));
  }
  return Status::Ok();
}

Range StageLayers(const ParallelLayout& l, uint32_t num_layers, uint32_t stage) {
  const uint32_t base = num_layers / l.pp, extra = num_layers % l.pp;
  const uint32_t begin = stage * base + (stage < extra ? stage : extra);
  return {begin, begin + base + (stage < extra ? 1u : 0u)};
}

Range TpSlice(const ParallelLayout& l, uint32_t n, uint32_t tp_rank) {
  const uint32_t per = n / l.tp;
  return {tp_rank * per, (tp_rank + 1) * per};
}

Range TpHeads(const ParallelLayout& l, uint32_t num_heads, uint32_t tp_rank) {
  return TpSlice(l, num_heads, tp_rank);
}

Range TpKvHeads(const ParallelLayout& l, uint32_t num_kv_heads, uint32_t tp_rank) {
  if (num_kv_heads >= l.tp) return TpSlice(l, num_kv_heads, tp_rank);
  const uint32_t ranks_per_head = l.tp / num_kv_heads;
  const uint32_t head = tp_rank / ranks_per_head;
  return {head, head + 1};
}

std::string ToString(const ParallelLayout& l) { return fmt::format("tp{}pp{}", l.tp, l.pp); }

}  // namespace tandem::parallel
