#include "proxy/planner.h"

#include <prometheus/registry.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <array>
#include <cmath>

#include "proxy/fleet.h"

namespace tandem::proxy {
namespace {

using Clock = std::chrono::steady_clock;

double NowSeconds() {
  return std::chrono::duration<double>(Clock::now().time_since_epoch()).count();
}

uint32_t Clamp(uint32_t v, const AutoscaleRoleConfig& b) { return std::clamp(v, b.min, b.max); }

std::vector<prometheus::ClientMetric::Bucket> Buckets(const prometheus::Histogram* h) {
  return h->Collect().histogram.bucket;
}

}  // namespace

PlannerPolicy::PlannerPolicy(const AutoscaleConfig& config, uint32_t initial_prefill,
                             uint32_t initial_decode)
    : config_(config) {
  prefill_.desired = Clamp(initial_prefill, config.prefill);
  decode_.desired = Clamp(initial_decode, config.decode);
}

void PlannerPolicy::Step(RoleState& s, const AutoscaleRoleConfig& bounds, uint32_t current,
                         double latency, double load, double now_s) const {
  s.desired = Clamp(s.desired, bounds);
  if (current == 0) return;  // none registered yet (starting, or all lost): nothing measured
  const double since = now_s - s.last_change_s;
  const double pressure = std::max(latency, load);
  if (pressure > 1.0) {
    if (since < config_.scale_up_cooldown_s) return;
    const double proportional = std::ceil(current * pressure - 1e-9);
    const double capped = std::min(proportional, 2.0 * current);
    const uint32_t want =
        Clamp(static_cast<uint32_t>(std::max<double>(current + 1, capped)), bounds);
    if (want > s.desired) {
      s.desired = want;
      s.last_change_s = now_s;
    }
    return;
  }
  if (current <= 1 || current < s.desired || s.desired <= bounds.min) return;
  if (since < config_.scale_down_cooldown_s) return;
  // Latency has a floor no worker count removes (one prompt's own prefill,
  // one step's time), so it is not scaled by current / (current - 1): it
  // must simply be well under target. The load measures are.
  const double load_on_one_fewer = load * current / (current - 1);
  if (latency < config_.scale_down_below && load_on_one_fewer < config_.scale_down_below) {
    s.desired = Clamp(std::min(s.desired, current) - 1, bounds);
    s.last_change_s = now_s;
  }
}

PlannerDecision PlannerPolicy::Evaluate(const PlannerInputs& in, double now_s) {
  PlannerDecision d;
  const double ttft_ratio =
      in.ttft_p90_s < 0 ? 0.0 : in.ttft_p90_s * 1000.0 / config_.ttft_target_ms;
  const double queue_ratio =
      in.prefillers == 0
          ? 0.0
          : std::max(in.queued_prefill_tokens / config_.queued_prefill_tokens_target,
                     in.awaiting_first_token / config_.awaiting_first_token_target) /
                in.prefillers;
  const double itl_ratio = in.itl_p90_s < 0 ? 0.0 : in.itl_p90_s * 1000.0 / config_.itl_target_ms;
  const double kv_ratio = in.kv_usage / config_.kv_usage_target;
  d.prefill_pressure = std::max(ttft_ratio, queue_ratio);
  d.decode_pressure = std::max(itl_ratio, kv_ratio);
  Step(prefill_, config_.prefill, in.prefillers, ttft_ratio, queue_ratio, now_s);
  Step(decode_, config_.decode, in.decoders, itl_ratio, kv_ratio, now_s);
  d.prefill = prefill_.desired;
  d.decode = decode_.desired;
  return d;
}

double WindowQuantile(const std::vector<prometheus::ClientMetric::Bucket>& before,
                      const std::vector<prometheus::ClientMetric::Bucket>& now, double q) {
  if (now.empty()) return -1;
  auto count = [&](size_t i) -> double {
    const double b = i < before.size() ? static_cast<double>(before[i].cumulative_count) : 0.0;
    return static_cast<double>(now[i].cumulative_count) - b;
  };
  const double total = count(now.size() - 1);
  if (total <= 0) return -1;
  const double rank = q * total;
  double lower_bound = 0, lower_count = 0;
  for (size_t i = 0; i < now.size(); ++i) {
    const double c = count(i);
    if (c >= rank) {
      // The +Inf bucket: the highest finite bound, as histogram_quantile.
      if (std::isinf(now[i].upper_bound)) return i > 0 ? now[i - 1].upper_bound : 0.0;
      const double in_bucket = c - lower_count;
      const double frac = in_bucket > 0 ? (rank - lower_count) / in_bucket : 1.0;
      return lower_bound + (now[i].upper_bound - lower_bound) * frac;
    }
    lower_bound = now[i].upper_bound;
    lower_count = c;
  }
  return lower_bound;
}

Planner::Planner(const FleetConfig& fleet, Fleet* workers, prometheus::Histogram* ttft,
                 prometheus::Histogram* itl, MetricsRegistry& registry)
    : config_(fleet.autoscale),
      registry_(registry),
      fleet_(workers),
      ttft_(ttft),
      itl_(itl),
      policy_(fleet.autoscale, fleet.prefill.replicas, fleet.decode.replicas) {
  // Built here rather than through MetricsRegistry: its constant `role`
  // label (proxy) would replace the workers' role these series are about.
  auto& desired = prometheus::BuildGauge()
                      .Name("tandem_planner_desired_workers")
                      .Help("Workers of this role the autoscaling planner wants (0: autoscale "
                            "disabled)")
                      .Register(*registry.registry());
  auto& fleet_family = prometheus::BuildGauge()
                           .Name("tandem_fleet_workers")
                           .Help("Workers of this role registered with this proxy")
                           .Register(*registry.registry());
  const std::string& model = fleet.model.name;
  auto labels = [&model](const char* role) {
    return std::map<std::string, std::string>{{"model", model}, {"role", role}, {"worker", "proxy"}};
  };
  desired_prefill_ = &desired.Add(labels("prefill"));
  desired_decode_ = &desired.Add(labels("decode"));
  fleet_prefill_ = &fleet_family.Add(labels("prefill"));
  fleet_decode_ = &fleet_family.Add(labels("decode"));
  fleet_both_ = &fleet_family.Add(labels("both"));
  if (config_.enabled) {
    desired_prefill_->Set(policy_.desired_prefill());
    desired_decode_->Set(policy_.desired_decode());
  }
  registry_.OnScrape([this] { CountWorkers(); });
}

Planner::~Planner() {
  registry_.OnScrape({});  // returns once no scrape runs CountWorkers any more
  Stop();
}

void Planner::CountWorkers() {
  std::array<uint32_t, 3> n{};
  for (const WorkerRecord& w : fleet_->Workers()) ++n[static_cast<size_t>(w.role)];
  fleet_prefill_->Set(n[static_cast<size_t>(router::WorkerRole::kPrefill)]);
  fleet_decode_->Set(n[static_cast<size_t>(router::WorkerRole::kDecode)]);
  fleet_both_->Set(n[static_cast<size_t>(router::WorkerRole::kBoth)]);
}

void Planner::Start() {
  std::lock_guard lock(mu_);
  if (thread_.joinable()) return;
  stop_ = false;
  thread_ = std::thread([this] {
    const auto period = std::chrono::duration_cast<Clock::duration>(
        std::chrono::duration<double>(config_.interval_s));
    while (true) {
      {
        std::unique_lock lock(mu_);
        if (wake_.wait_for(lock, period, [this] { return stop_; })) return;
      }
      Tick();
    }
  });
}

void Planner::Stop() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

PlannerInputs Planner::Measure(double now_s) {
  PlannerInputs in;
  double kv_sum = 0;
  uint32_t kv_known = 0;
  for (const WorkerRecord& w : fleet_->Workers()) {
    const auto id = fleet_->router().FindWorker(w.name);
    const auto load = id ? fleet_->router().load(*id) : Result<router::WorkerLoad>(
                                                            NotFoundError("left"));
    switch (w.role) {
      case router::WorkerRole::kPrefill:
        ++in.prefillers;
        if (load.ok()) in.queued_prefill_tokens += static_cast<double>(load->queued_prefill_tokens);
        break;
      case router::WorkerRole::kDecode:
        ++in.decoders;
        if (load.ok() && load->free_known && w.num_blocks > 0) {
          const double free = static_cast<double>(load->free_blocks);
          kv_sum += std::clamp(1.0 - free / w.num_blocks, 0.0, 1.0);
          ++kv_known;
        }
        break;
      case router::WorkerRole::kBoth:
        break;
    }
  }
  registry_.RunCollectHooks();  // (the token path's ITL samples held between scrapes)
  const prometheus::ClientMetric ttft_now = ttft_->Collect();
  Snapshot now{now_s, ttft_now.histogram.bucket, Buckets(itl_), ttft_now.histogram.sample_sum,
               in.queued_prefill_tokens, kv_known > 0 ? kv_sum / kv_known : 0.0};
  while (snapshots_.size() > 1 && snapshots_[1].time_s <= now_s - config_.window_s) {
    snapshots_.pop_front();
  }
  if (!snapshots_.empty()) {
    in.ttft_p90_s = WindowQuantile(snapshots_.front().ttft, now.ttft, 0.9);
    in.itl_p90_s = WindowQuantile(snapshots_.front().itl, now.itl, 0.9);
    const double span = now_s - snapshots_.front().time_s;
    if (span > 0) in.awaiting_first_token = (now.ttft_sum - snapshots_.front().ttft_sum) / span;
  }
  snapshots_.push_back(std::move(now));
  // Queue and KV usage: the mean of the ticks within the window (the oldest
  // kept snapshot is the window's base for the quantiles, not a tick of it).
  double queued = 0, kv = 0;
  size_t n = 0;
  for (const Snapshot& s : snapshots_) {
    if (s.time_s <= now_s - config_.window_s) continue;
    queued += s.queued_prefill_tokens;
    kv += s.kv_usage;
    ++n;
  }
  in.queued_prefill_tokens = queued / static_cast<double>(n);  // n >= 1: this tick
  in.kv_usage = kv / static_cast<double>(n);
  return in;
}

PlannerDecision Planner::Tick() {
  std::lock_guard lock(mu_);
  const double now_s = NowSeconds();
  const PlannerInputs in = Measure(now_s);
  if (!config_.enabled) return PlannerDecision{};
  const uint32_t before_p = policy_.desired_prefill(), before_d = policy_.desired_decode();
  const PlannerDecision d = policy_.Evaluate(in, now_s);
  desired_prefill_->Set(d.prefill);
  desired_decode_->Set(d.decode);
  if (d.prefill != before_p || d.decode != before_d) {
    spdlog::info(
        "planner: desired prefill {} -> {}, decode {} -> {} (registered {}P {}D; over {} s: TTFT "
        "p90 {:.0f} ms, ITL p90 {:.1f} ms, queued prefill tokens {:.0f}, awaiting first token "
        "{:.2f}, KV usage {:.2f}; pressure prefill {:.2f} decode {:.2f})",
        before_p, d.prefill, before_d, d.decode, in.prefillers, in.decoders, config_.window_s,
        in.ttft_p90_s * 1000, in.itl_p90_s * 1000, in.queued_prefill_tokens,
        in.awaiting_first_token, in.kv_usage,
        d.prefill_pressure, d.decode_pressure);
  }
  return d;
}

}  // namespace tandem::proxy
