// `tandem plan`: aggregated or disaggregated, and with which P:D ratio, for
// a model on a hardware profile, a link and a workload — from the same
// roofline TimingModel the `sim` backend runs (src/sim, docs/sim.md).
//
//   tandem plan [--config FLEET.yaml] [--model CONFIG_JSON] [--hardware H100|H200|A100|L40S]
//               [--tp N] [--pp M] [--gpus-per-node G] [--intra-node-link L]
//               [--inter-node-link L] [--recommend-parallel [--max-gpus-per-worker N]]
//               [--link-gbps G] [--link-latency-us U] --rate R
//               --input-tokens N|MIN-MAX --output-tokens N|MIN-MAX [--prefix-reuse F]
//               [--itl-slo-ms MS] [--max-batched-tokens N] [--max-num-seqs N]
//               [--compute-efficiency E] [--memory-efficiency E] [--json]
//
// A fleet file's `sim` and `scheduler` sections give the defaults; flags win.
// --recommend-parallel plans every tp x pp layout and picks one (issue 18,
// sim::RecommendParallel; docs/sim.md).
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
  std::optional<uint32_t> tp, pp, gpus_per_node, max_batched_tokens, max_num_seqs;
  std::optional<std::string> intra_link, inter_link;
  bool recommend_parallel = false;
  std::optional<uint32_t> decode_batch;
  uint32_t max_gpus_per_worker = 16;
  std::optional<double> link_gbps, link_latency_us, compute_eff, memory_eff;
  double rate = 0;
  std::string input, output;
  double prefix_reuse = 0;
  double itl_slo_ms = 50;
  bool json = false;
};

int RunPlan(const PlanArgs& a) {
  SimConfig sim;
  uint32_t max_batched = 2048, max_seqs = 128, block_size = 16, pipeline_parallel = 1;
  if (!a.config.empty()) {
    auto fleet = LoadFleetConfig(a.config);
    if (!fleet.ok()) {
      std::cerr << fleet.status().message() << "\n";
      return 1;
    }
    if (fleet->sim.present) sim = fleet->sim;
    // The layout of the file's decoders (else its aggregated workers).
    const RoleConfig& role = fleet->decode.replicas > 0 ? fleet->decode : fleet->both;
    if (role.tensor_parallel > 1) sim.tensor_parallel = role.tensor_parallel;
    pipeline_parallel = role.pipeline_parallel;
    max_batched = fleet->scheduler.max_batched_tokens;
    max_seqs = fleet->scheduler.max_num_seqs;
    block_size = fleet->cache.block_size;
  }
  if (a.model) sim.model_shape = *a.model;
  if (a.hardware) sim.profile = *a.hardware;
  if (a.tp) sim.tensor_parallel = *a.tp;
  if (a.gpus_per_node) sim.gpus_per_node = *a.gpus_per_node;
  if (a.intra_link) sim.intra_node_link = *a.intra_link;
  if (a.inter_link) sim.inter_node_link = *a.inter_link;
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
  tp.pipeline_parallel = a.pp.value_or(pipeline_parallel);
  tp.gpus_per_node = sim.gpus_per_node;
  auto intra = sim::ParseLinkClass(sim.intra_node_link, "--intra-node-link");
  auto inter = sim::ParseLinkClass(sim.inter_node_link, "--inter-node-link");
  if (!intra.ok() || !inter.ok()) {
    std::cerr << "tandem plan: "
              << (!intra.ok() ? intra.status().message() : inter.status().message()) << "\n";
    return 1;
  }
  tp.intra_node_link = *intra;
  tp.inter_node_link = *inter;
  tp.compute_efficiency = sim.compute_efficiency;
  tp.memory_efficiency = sim.memory_efficiency;
  tp.gpu_memory_utilization = sim.gpu_memory_utilization;
  tp.step_overhead_s = sim.step_overhead_us * 1e-6;
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
  std::optional<sim::ParallelRecommendation> rec;
  if (a.recommend_parallel) {
    auto r = sim::RecommendParallel(tp, o, a.max_gpus_per_worker);
    if (!r.ok()) {
      std::cerr << "tandem plan: " << r.status().message() << "\n";
      return 1;
    }
    rec = std::move(r).value();
    if (rec->best < 0) {
      std::cerr << "tandem plan: " << rec->reason << " within " << a.max_gpus_per_worker
                << " GPUs per worker\n";
      return 1;
    }
    const sim::LayoutCandidate& best = rec->candidates[static_cast<size_t>(rec->best)];
    tp.tensor_parallel = best.tp;
    tp.pipeline_parallel = best.pp;
  }
  auto model = sim::TimingModel::Create(tp);
  if (!model.ok()) {
    std::cerr << "tandem plan: " << model.status().message() << "\n";
    return 1;
  }
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
    j["tensor_parallel"] = tp.tensor_parallel;
    j["pipeline_parallel"] = tp.pipeline_parallel;
    j["gpus_per_node"] = tp.gpus_per_node;
    j["nodes_per_worker"] = model->nodes();
    j["tp_link"] = model->tp_link().name;
    j["pp_link"] = model->pp_link().name;
    if (rec) {
      nlohmann::json cands = nlohmann::json::array();
      for (const auto& c : rec->candidates) {
        cands.push_back({{"tensor_parallel", c.tp}, {"pipeline_parallel", c.pp}, {"fits", c.fits},
                         {"feasible", c.feasible}, {"gpus", c.gpus}, {"itl_seconds", c.itl_s},
                         {"nodes", c.nodes}, {"kv_tokens", c.kv_tokens}, {"why_not", c.why_not}});
      }
      j["parallel_candidates"] = cands;
      j["parallel_reason"] = rec->reason;
    }
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
    std::cout << "tandem plan (simulated: roofline model of the hardware profile, no GPU used)\n";
    if (rec) {
      sim::Plan layouts;
      layouts.rows = rec->rows;
      std::cout << sim::FormatPlan(layouts) << "\n";
    }
    std::cout << sim::FormatPlan(*plan);
    if (a.decode_batch) {
      // The modelled decode step of a closed-loop load of that many streams
      // at the mean context (bench/sim/tp_pp.sh compares it with a fleet).
      const uint64_t ctx = static_cast<uint64_t>(input->mean + output->mean / 2);
      const sim::StepCost d = model->Decode(*a.decode_batch, ctx);
      std::cout << fmt::format(
          "decode step, batch {} at {} tokens of context: {:.2f} ms ({:.2f} ms all-reduce/"
          "gather/send in a slot of {:.2f} ms, {} micro-batch(es)); {:.0f} tokens/s\n",
          *a.decode_batch, ctx, d.seconds * 1e3, d.comm_seconds * 1e3, d.slot_seconds * 1e3,
          d.microbatches, *a.decode_batch / d.seconds);
    }
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
  cmd->add_option("--pp", a->pp, "pipeline stages per worker (default 1)")
      ->check(CLI::Range(1, 64));
  cmd->add_option("--gpus-per-node", a->gpus_per_node,
                  "GPUs per node: ranks beyond it use the inter-node link (default 8)")
      ->check(CLI::Range(1, 1024));
  cmd->add_option("--intra-node-link", a->intra_link, "nvlink | pcie | rdma | ethernet (default nvlink)");
  cmd->add_option("--inter-node-link", a->inter_link, "nvlink | pcie | rdma | ethernet (default rdma)");
  cmd->add_flag("--recommend-parallel", a->recommend_parallel,
                "plan every TP x PP layout and recommend the one needing the fewest GPUs");
  cmd->add_option("--max-gpus-per-worker", a->max_gpus_per_worker,
                  "largest TP x PP searched (default 16)")
      ->check(CLI::Range(1, 1024));
  cmd->add_option("--decode-batch", a->decode_batch,
                  "also print the modelled decode step of this many sequences")
      ->check(CLI::Range(1, 1 << 16));
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
