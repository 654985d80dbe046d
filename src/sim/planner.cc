#include "sim/planner.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cmath>

namespace tandem::sim {
namespace {

bool ParseU64(std::string_view s, uint64_t& out) {
  const auto r = std::from_chars(s.data(), s.data() + s.size(), out);
  return r.ec == std::errc() && r.ptr == s.data() + s.size();
}

std::string Ms(double s) { return fmt::format("{:.2f} ms", s * 1e3); }

// Running sequences per worker and ITL for `workers` workers; `busy` is the
// share of each worker's time taken by prefill (0 on a decoder).
DecodeFit FitDecode(const TimingModel& m, const PlanOptions& o, uint32_t workers, double busy,
                    double kv_cap_seqs) {
  const Workload& w = o.workload;
  const uint64_t ctx = static_cast<uint64_t>(w.input.mean + w.output.mean / 2);
  // Decode step time at a (fractional) mean batch.
  auto step = [&m, ctx](double batch) { return m.DecodeSeconds(std::max(batch, 1.0), ctx); };
  const double tokens_per_s = w.rate_per_s / workers * w.output.mean;  // per worker
  DecodeFit f;
  f.workers = workers;
  if (busy >= o.target_utilization) {
    f.why_not = fmt::format("prefill alone keeps each worker {:.0f}% busy", busy * 100);
    return f;
  }
  const double cap = std::min<double>(o.max_num_seqs, kv_cap_seqs);
  double b = 1.0;
  bool converged = false;
  for (int i = 0; i < 500; ++i) {
    const double itl = step(b) / (1.0 - busy);
    const double next = tokens_per_s * itl;  // Little's law
    if (next > cap * 4) break;              // diverging
    if (std::abs(next - b) < 1e-6) {
      b = next;
      converged = true;
      break;
    }
    b = next;
  }
  f.batch = b;
  f.itl_s = step(b) / (1.0 - busy);
  if (!converged || b > cap) {
    f.why_not = fmt::format("needs more than {:.0f} running sequences per worker (max_num_seqs "
                            "{}, KV room for {:.0f})",
                            cap, o.max_num_seqs, kv_cap_seqs);
    return f;
  }
  f.feasible = true;
  return f;
}

}  // namespace

Result<LengthDist> ParseLengthDist(const std::string& text, const std::string& what) {
  const auto dash = text.find('-');
  uint64_t lo = 0, hi = 0;
  bool ok;
  if (dash == std::string::npos) {
    ok = ParseU64(text, lo);
    hi = lo;
  } else {
    ok = ParseU64(std::string_view(text).substr(0, dash), lo) &&
         ParseU64(std::string_view(text).substr(dash + 1), hi);
  }
  if (!ok || lo == 0 || hi < lo) {
    return InvalidArgumentError(fmt::format(
        "{} must be N or MIN-MAX with 1 <= MIN <= MAX (token counts), got '{}'", what, text));
  }
  return LengthDist{(static_cast<double>(lo) + static_cast<double>(hi)) / 2.0, hi};
}

Result<Plan> MakePlan(const TimingModel& m, const PlanOptions& o) {
  const Workload& w = o.workload;
  if (w.rate_per_s <= 0) return InvalidArgumentError("the request rate must be > 0");
  if (w.input.mean < 1 || w.output.mean < 1) {
    return InvalidArgumentError("input and output lengths must be >= 1 token");
  }
  if (w.prefix_reuse < 0 || w.prefix_reuse >= 1) {
    return InvalidArgumentError(
        fmt::format("prefix reuse must be in [0, 1), got {}", w.prefix_reuse));
  }
  if (o.max_batched_tokens == 0 || o.max_num_seqs == 0 || o.max_workers == 0) {
    return InvalidArgumentError("max_batched_tokens, max_num_seqs and max_workers must be > 0");
  }
  Plan p;
  const TimingParams& tp = m.params();
  const uint64_t cached = static_cast<uint64_t>(w.input.mean * w.prefix_reuse);
  const uint64_t fresh = std::max<uint64_t>(1, static_cast<uint64_t>(w.input.mean) - cached);
  const uint64_t cached_max = static_cast<uint64_t>(static_cast<double>(w.input.max) * w.prefix_reuse);
  const uint64_t fresh_max = std::max<uint64_t>(1, w.input.max - cached_max);
  const StepCost pre = m.Prefill(fresh, cached);
  p.prefill_s = pre.seconds;
  p.prefill_max_s = m.Prefill(fresh_max, cached_max).seconds;
  p.transfer_s = m.TransferSeconds(fresh, o.link);
  p.overhead_ratio = p.transfer_s / p.prefill_s;
  p.overhead_ok = p.overhead_ratio <= o.overhead_limit;

  const double kv_seqs = static_cast<double>(m.KvCapacityTokens()) /
                         (w.input.mean + w.output.mean);

  // Disaggregated: prefillers by compute time, decoders by Little's law.
  const double prefill_load = w.rate_per_s * p.prefill_s;  // busy devices' worth
  p.prefillers = std::max<uint32_t>(
      1, static_cast<uint32_t>(std::ceil(prefill_load / o.target_utilization)));
  p.prefill_utilization = prefill_load / p.prefillers;
  for (uint32_t d = 1; d <= o.max_workers; ++d) {
    p.decode = FitDecode(m, o, d, 0.0, kv_seqs);
    if (p.decode.feasible && p.decode.itl_s <= o.itl_slo_s) break;
    if (p.decode.feasible) {
      p.decode.feasible = false;
      p.decode.why_not = fmt::format("ITL {} exceeds the SLO {}", Ms(p.decode.itl_s), Ms(o.itl_slo_s));
    }
  }
  {
    const double rho = p.prefill_utilization;
    const double wait = rho < 1 ? rho * p.prefill_s / (2 * (1 - rho)) : INFINITY;  // M/D/1
    p.disagg_ttft_s = wait + p.prefill_s + p.transfer_s;
  }

  // Aggregated: every worker prefills (chunks of max_batched_tokens mixed
  // into its decode steps) and decodes.
  const uint64_t chunk = std::min<uint64_t>(o.max_batched_tokens, fresh_max);
  const uint64_t ctx = static_cast<uint64_t>(w.input.mean + w.output.mean / 2);
  double chunk_steps_per_prompt = std::ceil(static_cast<double>(fresh) / o.max_batched_tokens);
  for (uint32_t a = 1; a <= o.max_workers; ++a) {
    const double busy = w.rate_per_s / a * p.prefill_s;
    DecodeFit f = FitDecode(m, o, a, busy, kv_seqs);
    if (f.feasible || a == o.max_workers) {
      // The step that carries the last chunk of the longest prompt.
      std::vector<SeqWork> step(static_cast<size_t>(std::ceil(std::max(f.batch, 0.0))),
                                SeqWork{1, ctx, 1});
      step.push_back(SeqWork{chunk, w.input.max - chunk, 1});
      f.itl_spike_s = m.Step(step).seconds;
      // Share of steps that carry a chunk: chunk steps per second x step time.
      const double share = w.rate_per_s / a * chunk_steps_per_prompt * f.itl_spike_s;
      const double itl_p99 = share >= 0.01 ? f.itl_spike_s : f.itl_s;
      if (f.feasible && itl_p99 > o.itl_slo_s) {
        f.feasible = false;
        f.why_not = fmt::format("a step carrying a {}-token prefill chunk takes {} > ITL SLO {} "
                                "({:.0f}% of steps carry one)",
                                chunk, Ms(f.itl_spike_s), Ms(o.itl_slo_s), share * 100);
      }
    }
    p.aggregated = f;
    if (f.feasible) break;
  }
  {
    const double steps = std::ceil(static_cast<double>(fresh) / o.max_batched_tokens);
    p.agg_ttft_s = steps * std::max(p.aggregated.itl_spike_s, p.prefill_s / steps);
  }

  // The answer.
  const uint32_t disagg_workers = p.prefillers + p.decode.workers;
  const uint32_t agg_workers = p.aggregated.workers;
  if (!p.overhead_ok) {
    p.disaggregate = false;
    p.reason = fmt::format("KV transfer takes {:.2f} of the prefill it offloads (> {:.2f}): "
                           "aggregate", p.overhead_ratio, o.overhead_limit);
  } else if (p.decode.feasible && !p.aggregated.feasible) {
    p.disaggregate = true;
    p.reason = fmt::format("aggregated workers miss the ITL SLO ({}); disaggregated ones meet it",
                           p.aggregated.why_not);
  } else if (!p.decode.feasible && p.aggregated.feasible) {
    p.disaggregate = false;
    p.reason = fmt::format("decoders cannot meet the ITL SLO ({})", p.decode.why_not);
  } else if (p.decode.feasible && p.aggregated.feasible) {
    p.disaggregate = disagg_workers < agg_workers;
    p.reason = p.disaggregate
                   ? fmt::format("both meet the SLO; disaggregated needs fewer workers ({} vs {})",
                                 disagg_workers, agg_workers)
                   : fmt::format("both meet the SLO; aggregated needs no more workers ({} vs {}) "
                                 "and moves no KV", agg_workers, disagg_workers);
  } else {
    p.disaggregate = p.overhead_ok;
    p.reason = fmt::format("neither meets the SLO within {} workers per role (decoders: {}; "
                           "aggregated: {})", o.max_workers, p.decode.why_not,
                           p.aggregated.why_not);
  }

  auto row = [&p](std::string q, std::string v, std::string n) {
    p.rows.push_back({std::move(q), std::move(v), std::move(n)});
  };
  row("model (simulated)", m.Describe(), tp.hardware.description);
  row("link", fmt::format("{:g} Gb/s, {:g} us", o.link.bits_per_s / 1e9, o.link.latency_s * 1e6),
      "per prefiller, transfers queue on it");
  row("workload", fmt::format("{:g} req/s, input {:.0f} (max {}), output {:.0f} (max {}), reuse {:.2f}",
                              w.rate_per_s, w.input.mean, w.input.max, w.output.mean,
                              w.output.max, w.prefix_reuse),
      "Poisson arrivals");
  row("prefill, mean prompt", Ms(p.prefill_s),
      fmt::format("{} new + {} cached tokens, {}-bound, {:.2f} TFLOP", fresh, cached,
                  pre.compute_bound() ? "compute" : "memory", pre.flops / 1e12));
  row("KV transfer, mean prompt", Ms(p.transfer_s),
      fmt::format("{:.1f} MB of KV", m.KvBytes(fresh) / 1e6));
  row("transfer / prefill", fmt::format("{:.3f}", p.overhead_ratio),
      p.overhead_ok ? fmt::format("<= {:.2f}: the transfer pays", o.overhead_limit)
                    : fmt::format("> {:.2f}: the transfer eats the gain", o.overhead_limit));
  row("KV capacity per worker", fmt::format("{} tokens", m.KvCapacityTokens()),
      fmt::format("{:.0f} mean sequences", kv_seqs));
  row("disagg: prefillers", fmt::format("{}", p.prefillers),
      fmt::format("{:.0f}% busy each (target {:.0f}%)", p.prefill_utilization * 100,
                  o.target_utilization * 100));
  row("disagg: decoders", fmt::format("{}", p.decode.workers),
      p.decode.feasible ? fmt::format("batch {:.1f}, ITL {}", p.decode.batch, Ms(p.decode.itl_s))
                        : "infeasible: " + p.decode.why_not);
  row("disagg: TTFT", Ms(p.disagg_ttft_s), "queue (M/D/1) + prefill + transfer");
  row("aggregated: workers", fmt::format("{}", p.aggregated.workers),
      p.aggregated.feasible
          ? fmt::format("batch {:.1f}, ITL mean {}, with a prefill chunk {}", p.aggregated.batch,
                        Ms(p.aggregated.itl_s), Ms(p.aggregated.itl_spike_s))
          : "infeasible: " + p.aggregated.why_not);
  row("aggregated: TTFT", Ms(p.agg_ttft_s), fmt::format("chunks of {} tokens", o.max_batched_tokens));
  row("recommendation", p.disaggregate ? "disaggregated" : "aggregated", p.reason);
  if (p.disaggregate) {
    row("P:D", fmt::format("{}:{}", p.prefillers, p.decode.workers),
        fmt::format("{} workers x{} devices", disagg_workers, m.world()));
  } else {
    row("workers", fmt::format("{} aggregated", agg_workers),
        fmt::format("x{} devices each", m.world()));
  }
  return p;
}

Result<ParallelRecommendation> RecommendParallel(const TimingParams& base,
                                                 const PlanOptions& o,
                                                 uint32_t max_gpus_per_worker) {
  if (max_gpus_per_worker == 0) return InvalidArgumentError("max GPUs per worker must be > 0");
  ParallelRecommendation r;
  for (uint32_t pp = 1; pp <= max_gpus_per_worker; pp *= 2) {
    for (uint32_t tp = 1; tp * pp <= max_gpus_per_worker; tp *= 2) {
      LayoutCandidate c;
      c.tp = tp;
      c.pp = pp;
      TimingParams params = base;
      params.tensor_parallel = tp;
      params.pipeline_parallel = pp;
      auto model = TimingModel::Create(params);
      if (!model.ok()) {
        c.why_not = std::string(model.status().message());
        r.candidates.push_back(std::move(c));
        continue;
      }
      c.fits = true;
      c.nodes = model->nodes();
      c.tp_link = tp > 1 ? model->tp_link().name : "-";
      c.pp_link = pp > 1 ? model->pp_link().name : "-";
      c.kv_tokens = model->KvCapacityTokens();
      auto plan = MakePlan(*model, o);
      if (!plan.ok()) return plan.status();
      c.plan = std::move(plan).value();
      const Plan& p = c.plan;
      const DecodeFit& fit = p.disaggregate ? p.decode : p.aggregated;
      c.feasible = fit.feasible;
      c.itl_s = fit.itl_s;
      c.gpus = tp * pp * (p.disaggregate ? p.prefillers + p.decode.workers : p.aggregated.workers);
      if (!c.feasible) c.why_not = fit.why_not;
      r.candidates.push_back(std::move(c));
    }
  }
  auto better = [](const LayoutCandidate& a, const LayoutCandidate& b) {
    if (a.gpus != b.gpus) return a.gpus < b.gpus;
    if (a.itl_s != b.itl_s) return a.itl_s < b.itl_s;
    return a.tp * a.pp < b.tp * b.pp;
  };
  for (size_t i = 0; i < r.candidates.size(); ++i) {
    const LayoutCandidate& c = r.candidates[i];
    if (!c.feasible) continue;
    if (r.best < 0 || better(c, r.candidates[static_cast<size_t>(r.best)])) r.best = static_cast<int>(i);
  }
  if (r.best >= 0) {
    const LayoutCandidate& b = r.candidates[static_cast<size_t>(r.best)];
    r.reason = fmt::format("fewest GPUs meeting the ITL SLO: {} in all ({} per worker, {} node{})",
                           b.gpus, b.tp * b.pp, b.nodes, b.nodes > 1 ? "s" : "");
  } else {
    // Nothing meets the SLO: the fastest layout that fits.
    for (size_t i = 0; i < r.candidates.size(); ++i) {
      const LayoutCandidate& c = r.candidates[i];
      if (!c.fits) continue;
      if (r.best < 0 || c.itl_s < r.candidates[static_cast<size_t>(r.best)].itl_s) {
        r.best = static_cast<int>(i);
      }
    }
    r.reason = r.best >= 0 ? "no layout meets the ITL SLO; the lowest ITL"
                           : "no layout holds the model";
  }
  for (const LayoutCandidate& c : r.candidates) {
    const std::string name = fmt::format("TP {} x PP {}", c.tp, c.pp);
    if (!c.fits) {
      r.rows.push_back({name, "does not fit", c.why_not});
      continue;
    }
    r.rows.push_back(
        {name,
         c.feasible ? fmt::format("{} GPUs, ITL {}", c.gpus, Ms(c.itl_s))
                    : "misses the SLO",
         fmt::format("{} node{}, TP over {}, PP over {}, KV {} tokens/worker{}", c.nodes,
                     c.nodes > 1 ? "s" : "", c.tp_link, c.pp_link, c.kv_tokens,
                     c.feasible ? "" : ": " + c.why_not)});
  }
  if (r.best >= 0) {
    const LayoutCandidate& b = r.candidates[static_cast<size_t>(r.best)];
    r.rows.push_back({"recommended layout", fmt::format("TP {} x PP {}", b.tp, b.pp), r.reason});
  } else {
    r.rows.push_back({"recommended layout", "none", r.reason});
  }
  return r;
}

std::string FormatPlan(const Plan& plan) {
  size_t wq = 8, wv = 5;
  for (const auto& r : plan.rows) {
    wq = std::max(wq, r.quantity.size());
    wv = std::max(wv, std::min<size_t>(r.value.size(), 48));
  }
  std::string out = fmt::format("{:<{}}  {:<{}}  {}\n", "quantity", wq, "value", wv, "why");
  for (const auto& r : plan.rows) {
    out += fmt::format("{:<{}}  {:<{}}  {}\n", r.quantity, wq, r.value, wv, r.note);
  }
  return out;
}

}  // namespace tandem::sim
