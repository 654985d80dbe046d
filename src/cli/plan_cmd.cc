// `tandem plan`: aggregated or disaggregated, and with which P:D ratio, for
// a model on a hardware profile, a link and a workload — from the same
// roofline TimingModel the `sim` backend runs (src/sim, docs/sim.md).
//
//   tandem plan [--config FLEET.yaml] [--model CONFIG_JSON] [--hardware H100|H200|A100|L40S]
//               [--tp N] [--link-gbps G] [--link-latency-us U] --rate R
//               --input-tokens N|MIN-MAX --output-tokens N|MIN-MAX [--prefix-reuse F]
//               [--itl-slo-ms MS] [--max-batched-tokens N] [--max-num-seqs N]
//               [--compute-efficiency E] [--memory-efficiency E] [--json]
//
// A fleet file's `sim` and `scheduler` sections give the defaults; flags win.
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <iostream>
#include <memory>
#include <optional>

#include "cli/commands.h"
#include "common/config.h"
#include "sim/planner.h"

namespace tandem::cli {
namespace {

struct PlanArgs {
  std::string config;
  std::optional<std::string> model, hardware;
  std::optional<uint32_t> tp, max_batched_tokens, max_num_seqs;
  std::optional<double> link_gbps, link_latency_us, compute_eff, memory_eff;
  double rate = 0;
  std::string input, output;
  double prefix_reuse = 0;
  double itl_slo_ms = 50;
  bool json = false;
};

int RunPlan(const PlanArgs& a) {
  SimConfig sim;
  uint32_t max_batched = 2048, max_seqs = 128, block_size = 16;
  if (!a.config.empty()) {
    auto fleet = LoadFleetConfig(a.config);
    if (!fleet.ok()) {
      std::cerr << fleet.status().message() << "\n";
      return 1;
    }
    if (fleet->sim.present) sim = fleet->sim;
    max_batched = fleet->scheduler.max_batched_tokens;
    max_seqs = fleet->scheduler.max_num_seqs;
    block_size = fleet->cache.block_size;
  }
  if (a.model) sim.model_shape = *a.model;
  if (a.hardware) sim.profile = *a.hardware;
  if (a.tp) sim.tensor_parallel = *a.tp;
  if (a.link_gbps) sim.link_gbps = *a.link_gbps;
  if (a.link_latency_us) sim.link_latency_us = *a.link_latency_us;
  if (a.compute_eff) sim.compute_efficiency = *a.compute_eff;
  if (a.memory_eff) sim.memory_efficiency = *a.memory_eff;
  if (a.max_batched_tokens) max_batched = *a.max_batched_tokens;
  if (a.max_num_seqs) max_seqs = *a.max_num_seqs;
  if (sim.model_shape.empty()) {
    std::cerr << "tandem plan: give --model CONFIG_JSON (e.g. "
                 "configs/sim/models/llama-3-8b/config.json) or a --config with a sim section\n";
    return 1;
  }
  auto hw = sim::FindHardwareProfile(sim.profile);
  if (!hw.ok()) {
    std::cerr << "tandem plan: --hardware: " << hw.status().message() << "\n";
    return 1;
  }
  auto shape = sim::LoadModelShape(sim.model_shape);
  if (!shape.ok()) {
    std::cerr << "tandem plan: --model: " << shape.status().message() << "\n";
    return 1;
  }
  sim::TimingParams tp;
  tp.hardware = *hw;
  tp.shape = *shape;
  tp.tensor_parallel = sim.tensor_parallel;
  tp.compute_efficiency = sim.compute_efficiency;
  tp.memory_efficiency = sim.memory_efficiency;
  tp.gpu_memory_utilization = sim.gpu_memory_utilization;
  tp.step_overhead_s = sim.step_overhead_us * 1e-6;
  auto model = sim::TimingModel::Create(tp);
  if (!model.ok()) {
    std::cerr << "tandem plan: " << model.status().message() << "\n";
    return 1;
  }
  auto input = sim::ParseLengthDist(a.input, "--input-tokens");
  auto output = sim::ParseLengthDist(a.output, "--output-tokens");
  if (!input.ok() || !output.ok()) {
    std::cerr << "tandem plan: "
              << (!input.ok() ? input.status().message() : output.status().message()) << "\n";
    return 1;
  }
  sim::PlanOptions o;
  o.link.bits_per_s = sim.link_gbps * 1e9;
  o.link.latency_s = sim.link_latency_us * 1e-6;
  o.workload.rate_per_s = a.rate;
  o.workload.input = *input;
  o.workload.output = *output;
  o.workload.prefix_reuse = a.prefix_reuse;
  o.max_batched_tokens = max_batched;
  o.max_num_seqs = max_seqs;
  o.block_size = block_size;
  o.itl_slo_s = a.itl_slo_ms * 1e-3;
  auto plan = sim::MakePlan(*model, o);
  if (!plan.ok()) {
    std::cerr << "tandem plan: " << plan.status().message() << "\n";
    return 1;
  }
  if (a.json) {
    nlohmann::json j;
    j["simulated"] = true;
    j["hardware"] = hw->name;
    j["model_shape"] = shape->name;
    j["tensor_parallel"] = sim.tensor_parallel;
    j["link_gbps"] = sim.link_gbps;
    j["prefill_seconds"] = plan->prefill_s;
    j["transfer_seconds"] = plan->transfer_s;
    j["overhead_ratio"] = plan->overhead_ratio;
    j["overhead_ok"] = plan->overhead_ok;
    j["recommendation"] = plan->disaggregate ? "disaggregated" : "aggregated";
    j["reason"] = plan->reason;
    j["prefillers"] = plan->prefillers;
    j["decoders"] = plan->decode.workers;
    j["decoders_feasible"] = plan->decode.feasible;
    j["decode_itl_seconds"] = plan->decode.itl_s;
    j["aggregated_workers"] = plan->aggregated.workers;
    j["aggregated_feasible"] = plan->aggregated.feasible;
    j["aggregated_itl_seconds"] = plan->aggregated.itl_s;
    j["aggregated_itl_spike_seconds"] = plan->aggregated.itl_spike_s;
    j["disagg_ttft_seconds"] = plan->disagg_ttft_s;
    j["aggregated_ttft_seconds"] = plan->agg_ttft_s;
    nlohmann::json rows = nlohmann::json::array();
    for (const auto& r : plan->rows) rows.push_back({{"quantity", r.quantity}, {"value", r.value}, {"note", r.note}});
    j["rows"] = rows;
    std::cout << j.dump(2) << "\n";
  } else {
    std::cout << "tandem plan (simulated: roofline model of the hardware profile, no GPU used)\n"
              << sim::FormatPlan(*plan);
  }
  return 0;
}

}  // namespace

void RegisterPlan(CLI::App& app, GlobalOptions& g) {
  auto a = std::make_shared<PlanArgs>();
  auto* cmd = app.add_subcommand(
      "plan", "Recommend aggregated vs disaggregated and the P:D ratio from the sim timing model");
  cmd->add_option("--config", a->config, "fleet YAML whose sim/scheduler sections give defaults");
  cmd->add_option("--model", a->model, "config.json (or its folder) of the model shape");
  cmd->add_option("--hardware", a->hardware, "H100 | H200 | A100 | L40S (default H100)");
  cmd->add_option("--tp", a->tp, "devices per worker (tensor parallel, default 1)")
      ->check(CLI::Range(1, 64));
  cmd->add_option("--link-gbps", a->link_gbps, "prefiller->decoder link, Gb/s (default 100)")
      ->check(CLI::Range(0.001, 1e5));
  cmd->add_option("--link-latency-us", a->link_latency_us, "per-transfer latency (default 10)")
      ->check(CLI::Range(0.0, 1e6));
  cmd->add_option("--rate", a->rate, "requests per second (Poisson)")
      ->required()
      ->check(CLI::Range(1e-6, 1e9));
  cmd->add_option("--input-tokens", a->input, "prompt tokens: N or MIN-MAX (uniform)")->required();
  cmd->add_option("--output-tokens", a->output, "generated tokens: N or MIN-MAX")->required();
  cmd->add_option("--prefix-reuse", a->prefix_reuse, "share of prompt tokens cached, [0, 1)")
      ->check(CLI::Range(0.0, 0.999));
  cmd->add_option("--itl-slo-ms", a->itl_slo_ms, "inter-token latency target (default 50)")
      ->check(CLI::Range(0.01, 1e6));
  cmd->add_option("--max-batched-tokens", a->max_batched_tokens,
                  "tokens per step (aggregated prefill chunk; default 2048 or the config's)")
      ->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--max-num-seqs", a->max_num_seqs, "running sequences per worker")
      ->check(CLI::Range(1, 1 << 16));
  cmd->add_option("--compute-efficiency", a->compute_eff, "achieved/peak FLOP/s (default 0.5)")
      ->check(CLI::Range(0.01, 1.0));
  cmd->add_option("--memory-efficiency", a->memory_eff, "achieved/peak bandwidth (default 0.8)")
      ->check(CLI::Range(0.01, 1.0));
  cmd->add_flag("--json", a->json, "print one JSON object");
  cmd->callback([a, &g] { g.exit_code = RunPlan(*a); });
}

}  // namespace tandem::cli
