#include "sim/timing_model.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "parallel/parallel_layout.h"

namespace tandem::sim {

Result<TimingModel> TimingModel::Create(TimingParams p) {
  auto in01 = [](double v) { return v > 0.0 && v <= 1.0; };
  if (!in01(p.compute_efficiency)) {
    return InvalidArgumentError(
        fmt::format("compute_efficiency must be in (0, 1], got {}", p.compute_efficiency));
  }
  if (!in01(p.memory_efficiency)) {
    return InvalidArgumentError(
        fmt::format("memory_efficiency must be in (0, 1], got {}", p.memory_efficiency));
  }
  if (!in01(p.gpu_memory_utilization)) {
    return InvalidArgumentError(fmt::format("gpu_memory_utilization must be in (0, 1], got {}",
                                            p.gpu_memory_utilization));
  }
  if (p.tensor_parallel < 1) return InvalidArgumentError("tensor_parallel must be >= 1");
  if (p.pipeline_parallel < 1) return InvalidArgumentError("pipeline_parallel must be >= 1");
  if (p.gpus_per_node < 1) return InvalidArgumentError("gpus_per_node must be >= 1");
  if (p.step_overhead_s < 0) return InvalidArgumentError("step_overhead must be >= 0");
  if (p.hardware.peak_flops <= 0 || p.hardware.memory_bytes_per_s <= 0 ||
      p.hardware.memory_bytes <= 0) {
    return InvalidArgumentError(fmt::format("hardware profile '{}' is incomplete", p.hardware.name));
  }
  if (p.shape.num_layers == 0 || p.shape.hidden_size == 0) {
    return InvalidArgumentError("the model shape is empty");
  }
  const parallel::ParallelLayout layout{p.tensor_parallel, p.pipeline_parallel};
  auto dim = [](uint64_t v) { return static_cast<uint32_t>(std::min<uint64_t>(v, UINT32_MAX)); };
  const parallel::ModelDims dims{dim(p.shape.num_layers), dim(p.shape.num_heads),
                                 dim(p.shape.num_kv_heads), dim(p.shape.intermediate_size),
                                 dim(p.shape.vocab_size)};
  if (Status s = parallel::CheckLayout(layout, dims); !s.ok()) {
    return s.WithContext(fmt::format("model '{}'", p.shape.name));
  }
  TimingModel m(std::move(p));
  m.Init();
  const double usable = m.p_.hardware.memory_bytes * m.p_.gpu_memory_utilization;
  const double weights = m.MaxRankWeightBytes();
  if (weights >= usable) {
    return InvalidArgumentError(fmt::format(
        "model '{}' needs {:.1f} GB of weights on its fullest rank (tensor_parallel {} x "
        "pipeline_parallel {}); a {} at gpu_memory_utilization {} leaves {:.1f} GB: raise "
        "tensor_parallel or pipeline_parallel",
        m.p_.shape.name, weights / 1e9, m.p_.tensor_parallel, m.p_.pipeline_parallel,
        m.p_.hardware.name, m.p_.gpu_memory_utilization, usable / 1e9));
  }
  return m;
}

void TimingModel::Init() {
  const parallel::ParallelLayout layout{p_.tensor_parallel, p_.pipeline_parallel};
  const uint32_t tp = p_.tensor_parallel, pp = p_.pipeline_parallel, g = p_.gpus_per_node;
  stage_layers_.clear();
  tp_nodes_.clear();
  send_crosses_.clear();
  for (uint32_t s = 0; s < pp; ++s) {
    stage_layers_.push_back(
        parallel::StageLayers(layout, static_cast<uint32_t>(p_.shape.num_layers), s).size());
    tp_nodes_.push_back(NodesSpanned(s * tp, tp, g));
    bool crosses = false;
    for (uint32_t i = 0; s + 1 < pp && i < tp; ++i) {
      crosses = crosses || (s * tp + i) / g != ((s + 1) * tp + i) / g;
    }
    send_crosses_.push_back(crosses);
  }
  kv_heads_per_rank_ =
      parallel::TpKvHeads(layout, static_cast<uint32_t>(p_.shape.num_kv_heads), 0).size();
}

uint32_t TimingModel::nodes() const { return NodesSpanned(0, world(), p_.gpus_per_node); }

const LinkSpec& TimingModel::tp_link() const {
  const bool crosses = std::any_of(tp_nodes_.begin(), tp_nodes_.end(), [](uint32_t n) { return n > 1; });
  return LinkSpecFor(crosses ? p_.inter_node_link : p_.intra_node_link);
}

const LinkSpec& TimingModel::pp_link() const {
  const bool crosses = std::find(send_crosses_.begin(), send_crosses_.end(), true) != send_crosses_.end();
  return LinkSpecFor(crosses ? p_.inter_node_link : p_.intra_node_link);
}

double TimingModel::RankWeightBytes(uint32_t stage) const {
  const ModelShape& s = p_.shape;
  const double tp = p_.tensor_parallel;
  const double frac = static_cast<double>(stage_layers_[stage]) / static_cast<double>(s.num_layers);
  const double embed = static_cast<double>(s.vocab_size * s.hidden_size);
  double params = static_cast<double>(s.linear_params()) * frac / tp +
                  2.0 * static_cast<double>(stage_layers_[stage] * s.hidden_size);  // norms
  const bool first = stage == 0, last = stage + 1 == p_.pipeline_parallel;
  if (first) params += embed / tp;
  // The LM head (and the final norm) on the last stage; a tied head shares
  // the embedding only when both are on the same rank.
  if (last) params += static_cast<double>(s.hidden_size);
  if (last && !(s.tie_word_embeddings && first)) params += embed / tp;
  return params * static_cast<double>(s.weight_dtype_bytes);
}

double TimingModel::MaxRankWeightBytes() const {
  double most = 0;
  for (uint32_t st = 0; st < p_.pipeline_parallel; ++st) most = std::max(most, RankWeightBytes(st));
  return most;
}

double TimingModel::RankKvBytesPerToken(uint32_t stage) const {
  return 2.0 * stage_layers_[stage] * kv_heads_per_rank_ * static_cast<double>(p_.shape.head_dim) *
         static_cast<double>(p_.shape.kv_dtype_bytes);
}

void TimingModel::Work::Add(const Work& w) {
  seqs += w.seqs;
  new_tokens += w.new_tokens;
  attn_pairs += w.attn_pairs;
  logits += w.logits;
  kv_tokens += w.kv_tokens;
}

double TimingModel::StageTime::total() const { return std::max(compute, memory) + comm; }

TimingModel::StageTime TimingModel::Stage(const Work& w, uint32_t stage) const {
  const ModelShape& s = p_.shape;
  const double tp = p_.tensor_parallel;
  const double layers = stage_layers_[stage];
  const double frac = layers / static_cast<double>(s.num_layers);
  const bool last = stage + 1 == p_.pipeline_parallel;
  const double hv = static_cast<double>(s.hidden_size * s.vocab_size);
  double flops = 2.0 * static_cast<double>(s.linear_params()) * frac / tp * w.new_tokens +
                 4.0 * layers * static_cast<double>(s.num_heads * s.head_dim) / tp * w.attn_pairs;
  double weights = static_cast<double>(s.linear_params()) * frac / tp;
  if (last) {
    flops += 2.0 * hv / tp * w.logits;
    weights += hv / tp;
  }
  const double bytes = weights * static_cast<double>(s.weight_dtype_bytes) +
                       RankKvBytesPerToken(stage) * w.kv_tokens;
  StageTime t;
  t.compute = flops / (p_.hardware.peak_flops * p_.compute_efficiency);
  t.memory = bytes / (p_.hardware.memory_bytes_per_s * p_.memory_efficiency);
  const LinkSpec& intra = LinkSpecFor(p_.intra_node_link);
  const LinkSpec& inter = LinkSpecFor(p_.inter_node_link);
  const double act = static_cast<double>(s.weight_dtype_bytes);  // activations in bf16
  if (p_.tensor_parallel > 1) {
    // Row-parallel o_proj and down_proj: 2 all-reduces of [tokens][hidden] per layer.
    t.comm += 2.0 * layers *
              RingAllReduceSeconds(w.new_tokens * static_cast<double>(s.hidden_size) * act,
                                   p_.tensor_parallel, tp_nodes_[stage], intra, inter);
    if (last && w.logits > 0) {  // vocab-parallel LM head: gather the logit rows
      t.comm += RingAllGatherSeconds(w.logits * static_cast<double>(s.vocab_size) * act,
                                     p_.tensor_parallel, tp_nodes_[stage], intra, inter);
    }
  }
  if (!last && w.new_tokens > 0) {
    t.comm += SendSeconds(w.new_tokens * static_cast<double>(s.hidden_size) * act,
                          send_crosses_[stage] ? inter : intra);
  }
  return t;
}

StepCost TimingModel::FromGroups(const std::vector<Work>& groups, bool decode_only) const {
  const ModelShape& s = p_.shape;
  StepCost cost;
  Work all;
  for (const Work& g : groups) all.Add(g);
  if (all.seqs == 0) return cost;
  cost.flops = 2.0 * static_cast<double>(s.linear_params()) * all.new_tokens +
               4.0 * static_cast<double>(s.num_layers * s.num_heads * s.head_dim) * all.attn_pairs +
               2.0 * static_cast<double>(s.hidden_size * s.vocab_size) * all.logits;
  cost.bytes = static_cast<double>(s.step_weight_bytes()) +
               static_cast<double>(s.kv_bytes_per_token()) * all.kv_tokens;
  const uint32_t pp = p_.pipeline_parallel;
  for (uint32_t st = 0; st < pp; ++st) {
    const StageTime t = Stage(all, st);
    cost.compute_seconds += t.compute;
    cost.memory_seconds += t.memory;
  }
  cost.microbatches = static_cast<uint32_t>(groups.size());
  if (pp == 1) {
    const StageTime t = Stage(all, 0);
    cost.comm_seconds = t.comm;
    cost.slot_seconds = t.total();
    cost.seconds = cost.slot_seconds;
  } else {
    for (const Work& g : groups) {
      for (uint32_t st = 0; st < pp; ++st) {
        const StageTime t = Stage(g, st);
        if (t.total() > cost.slot_seconds) {
          cost.slot_seconds = t.total();
          cost.comm_seconds = t.comm;
        }
      }
    }
    // Decode: the micro-batches stay in flight, so a step is one
    // micro-batch's round trip through the pp stages; a step carrying a
    // prefill chunk fills and drains the pipeline.
    cost.seconds = decode_only ? pp * cost.slot_seconds
                               : PipelineSeconds(cost.slot_seconds, cost.microbatches, pp);
  }
  cost.seconds += p_.step_overhead_s;
  return cost;
}

StepCost TimingModel::Step(std::span<const SeqWork> batch) const {
  // Scratch kept per thread (a model is shared by const reference): no
  // allocation per step (issue 23: a sim decoder's step runs this).
  thread_local std::vector<const SeqWork*> seqs;
  thread_local std::vector<Work> groups;
  seqs.clear();
  bool decode_only = true;
  for (const SeqWork& w : batch) {
    if (w.new_tokens == 0 && w.logit_rows == 0) continue;
    seqs.push_back(&w);
    decode_only = decode_only && w.new_tokens <= 1;
  }
  if (seqs.empty()) return {};
  const size_t m = std::min<size_t>(p_.pipeline_parallel, seqs.size());
  // Balance the micro-batches by new tokens: longest first onto the lightest.
  const auto longer = [](const SeqWork* a, const SeqWork* b) { return a->new_tokens > b->new_tokens; };
  if (!std::is_sorted(seqs.begin(), seqs.end(), longer)) {
    std::stable_sort(seqs.begin(), seqs.end(), longer);
  }
  groups.assign(m, Work{});
  for (const SeqWork* w : seqs) {
    auto lightest = std::min_element(groups.begin(), groups.end(), [](const Work& a, const Work& b) {
      return a.new_tokens < b.new_tokens || (a.new_tokens == b.new_tokens && a.seqs < b.seqs);
    });
    const double n = static_cast<double>(w->new_tokens);
    const double c = static_cast<double>(w->cached_tokens);
    lightest->Add(Work{1, n, n * c + n * (n + 1) / 2, static_cast<double>(w->logit_rows), c + n});
  }
  return FromGroups(groups, decode_only);
}

StepCost TimingModel::Prefill(uint64_t prompt_tokens, uint64_t cached_tokens) const {
  const SeqWork w{prompt_tokens, cached_tokens, 1};
  return Step(std::span<const SeqWork>(&w, 1));
}

StepCost TimingModel::Decode(uint64_t batch, uint64_t context_tokens) const {
  if (batch == 0) return {};
  const uint64_t m = std::min<uint64_t>(p_.pipeline_parallel, batch);
  const double c = static_cast<double>(context_tokens);
  std::vector<Work> groups;
  for (uint64_t j = 0; j < m; ++j) {
    // Sequences dealt round-robin: the first batch % m groups get one more.
    const double b = static_cast<double>(batch / m + (j < batch % m ? 1 : 0));
    groups.push_back(Work{b, b, b * (c + 1), b, b * (c + 1)});
  }
  return FromGroups(groups, true);
}

double TimingModel::DecodeSeconds(double batch, uint64_t context_tokens) const {
  batch = std::max(batch, 1.0);
  const double whole = std::floor(batch);
  if (batch == whole) return Decode(static_cast<uint64_t>(whole), context_tokens).seconds;
  // Between whole batches the step time is linear (both roofs are affine
  // in the batch for a fixed micro-batch count).
  const double lo = Decode(static_cast<uint64_t>(whole), context_tokens).seconds;
  const double hi = Decode(static_cast<uint64_t>(whole) + 1, context_tokens).seconds;
  return lo + (batch - whole) * (hi - lo);
}

uint64_t TimingModel::KvCapacityTokens() const {
  const double usable = p_.hardware.memory_bytes * p_.gpu_memory_utilization;
  double tokens = INFINITY;
  for (uint32_t st = 0; st < p_.pipeline_parallel; ++st) {
    const double left = usable - RankWeightBytes(st);
    if (left <= 0) return 0;
    tokens = std::min(tokens, left / RankKvBytesPerToken(st));
  }
  return static_cast<uint64_t>(tokens);
}

double TimingModel::TransferSeconds(uint64_t tokens, const LinkParams& link) const {
  if (tokens == 0) return 0.0;
  const double wire = link.bits_per_s > 0 ? KvBytes(tokens) * 8.0 / link.bits_per_s : 0.0;
  return link.latency_s + wire;
}

std::string TimingModel::Describe() const {
  std::string par;
  if (world() > 1) {
    par = fmt::format(" (tp {} x pp {} on {} node{}: TP over {}", p_.tensor_parallel,
                      p_.pipeline_parallel, nodes(), nodes() > 1 ? "s" : "", tp_link().name);
    par += p_.pipeline_parallel > 1 ? fmt::format(", PP over {})", pp_link().name) : ")";
  }
  return fmt::format("{} x{}{}, {} ({:.1f}B params, {} KiB KV/token), compute eff {:.2f}, "
                     "memory eff {:.2f}",
                     p_.hardware.name, world(), par, p_.shape.name,
                     static_cast<double>(p_.shape.total_params()) / 1e9,
                     p_.shape.kv_bytes_per_token() / 1024.0, p_.compute_efficiency,
                     p_.memory_efficiency);
}

}  // namespace tandem::sim
