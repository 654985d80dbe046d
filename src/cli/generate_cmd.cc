// `tandem generate`: one process, no network (DESIGN.md section 7).
//
//   tandem generate [--config FILE | --model DIR] (--prompt TEXT | --prompt-ids 1,2,3)
//                   --max-tokens N [--temperature T] [--seed S] [--ignore-eos] [--json]
//                   [--tensor-parallel N] [--pipeline-parallel M]
//
// Streams the completion's text to stdout as it is generated; with --json
// prints {"token_ids": [...], "text": "..."} of the completion only.
//
// With N * M > 1 (issue 18, docs/parallelism.md) this process is rank 0 of a
// CPU rank group and starts ranks 1 .. N*M-1 as `tandem rank` children
// (parallel/rank_processes.h: they die with it); a rank that exits early
// fails the command with a message naming the rank, and no rank outlives it.
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <iostream>
#include <mutex>
#include <optional>
#include <sstream>

#include "cli/commands.h"
#include "common/config.h"
#include "engine/engine.h"
#include "engine/llama_forward.h"
#include "model/model_config.h"
#include "model/tokenizer.h"
#include "model/weights.h"
#include "parallel/parallel_layout.h"
#include "parallel/rank_processes.h"

namespace tandem::cli {
namespace fs = std::filesystem;
namespace {

constexpr const char* kBundledModel = "models/tandem-kjv";

// The bundled model: models/tandem-kjv above the folder holding this binary,
// else under the working directory.
std::string DefaultModelDir() {
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    for (fs::path dir = exe.parent_path(); !dir.empty() && dir != dir.root_path();
         dir = dir.parent_path()) {
      const fs::path candidate = dir / kBundledModel;
      if (fs::exists(candidate / "config.json")) return candidate.string();
    }
  }
  return kBundledModel;
}

Result<std::vector<uint32_t>> ParseIds(const std::string& text) {
  std::vector<uint32_t> ids;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    const auto b = item.find_first_not_of(" \t");
    const auto e = item.find_last_not_of(" \t");
    if (b == std::string::npos) return InvalidArgumentError("--prompt-ids: empty entry");
    item = item.substr(b, e - b + 1);
    size_t used = 0;
    unsigned long v = 0;
    try {
      v = std::stoul(item, &used);
    } catch (...) {
      used = 0;
    }
    if (used != item.size() || v > UINT32_MAX) {
      return InvalidArgumentError(fmt::format("--prompt-ids: '{}' is not a token id", item));
    }
    ids.push_back(static_cast<uint32_t>(v));
  }
  if (ids.empty()) return InvalidArgumentError("--prompt-ids: no ids given");
  return ids;
}

struct GenerateArgs {
  std::string config;
  std::string model;
  std::optional<std::string> prompt;
  std::optional<std::string> prompt_ids;
  uint32_t max_tokens = 0;
  float temperature = 1.0f;
  std::optional<uint64_t> seed;
  bool ignore_eos = false;
  bool json = false;
  uint32_t tensor_parallel = 1;
  uint32_t pipeline_parallel = 1;
};

// The follower ranks of a parallel generate, watched while the engine runs:
// a rank that exits kills the others (so rank 0's step fails at once with
// UNAVAILABLE) and, should rank 0 still be stuck 10 s later (e.g. waiting
// for that rank to join), ends the process naming the rank.
class RankGroup {
 public:
  static Result<std::unique_ptr<RankGroup>> Start(const std::string& model_dir,
                                                  const parallel::ParallelLayout& layout,
                                                  const std::string& group, uint32_t num_blocks,
                                                  uint32_t block_size, uint32_t threads) {
    std::unique_ptr<RankGroup> g(new RankGroup());
    // The binary's real path as argv[0], so `ps` shows what runs.
    std::error_code ec;
    const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
    const std::string exe_path = ec ? "/proc/self/exe" : exe.string();
    TANDEM_ASSIGN_OR_RETURN(
        g->procs_, parallel::RankProcesses::Start(layout.world(), [&](uint32_t rank) {
          return std::vector<std::string>{
              exe_path, "rank", "--model", model_dir, "--tensor-parallel",
              std::to_string(layout.tp), "--pipeline-parallel", std::to_string(layout.pp),
              "--rank", std::to_string(rank), "--group", group, "--num-blocks",
              std::to_string(num_blocks), "--block-size", std::to_string(block_size),
              "--threads", std::to_string(threads)};
        }));
    RankGroup* self = g.get();
    g->procs_->Watch([self](const parallel::RankProcesses::Exit& e) { self->OnRankExit(e); });
    return g;
  }
  ~RankGroup() { Finish(); }

  // Rank 0 is done with the engine (any outcome): stop watching.
  void Finish() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ = true;
    }
    cv_.notify_all();
    if (procs_) procs_->StopWatching();
  }
  // After the shutdown plan: every rank must exit 0.
  Status WaitAll() { return procs_->WaitAll(10000); }
  std::string death() {
    std::lock_guard<std::mutex> lock(mu_);
    return death_;
  }

 private:
  RankGroup() = default;
  void OnRankExit(const parallel::RankProcesses::Exit& e) {
    std::unique_lock<std::mutex> lock(mu_);
    death_ = e.Describe();
    procs_->KillAll();
    if (!cv_.wait_for(lock, std::chrono::seconds(10), [this] { return done_; })) {
      std::cerr << "tandem generate: " << death_ << "\n";
      procs_->KillAll();
      _exit(1);
    }
  }

  std::unique_ptr<parallel::RankProcesses> procs_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::string death_;
};

Status Run(const GenerateArgs& a) {
  engine::EngineOptions options;
  std::string model_dir;
  if (!a.config.empty()) {
    TANDEM_ASSIGN_OR_RETURN(FleetConfig fleet, LoadFleetConfig(a.config));
    options = engine::EngineOptions::FromFleetConfig(fleet);
    model_dir = fleet.model.path;
  } else {
    model_dir = a.model.empty() ? DefaultModelDir() : a.model;
    options.hash_context.model_id = fs::path(model_dir).filename().string();
  }
  TANDEM_ASSIGN_OR_RETURN(model::ModelConfig config, model::LoadModelConfig(model_dir));
  std::unique_ptr<model::Tokenizer> tokenizer;
  if (auto t = model::Tokenizer::Load(model_dir); t.ok()) {
    tokenizer = std::move(*t);
  } else if (a.prompt) {
    return t.status().WithContext("--prompt needs the model's tokenizer");
  }
  std::vector<uint32_t> prompt;
  if (a.prompt) {
    prompt = tokenizer->Encode(*a.prompt, /*add_special_tokens=*/true);
  } else {
    TANDEM_ASSIGN_OR_RETURN(prompt, ParseIds(*a.prompt_ids));
  }
  // cuda: matrices straight to bf16 (half the host memory; docs/cuda.md).
  const auto format =
      options.backend == "cuda" ? model::WeightFormat::kBf16 : model::WeightFormat::kF32;
  TANDEM_ASSIGN_OR_RETURN(model::ModelWeights weights,
                          model::LoadWeights(model_dir, config, format));

  // One request: the pool needs no more than its own blocks (plus a spare).
  const uint64_t tokens = prompt.size() + uint64_t{a.max_tokens};
  const uint64_t need = (tokens + options.block_size - 1) / options.block_size + 1;
  if (a.config.empty() || options.num_blocks < need) {
    options.num_blocks = static_cast<uint32_t>(std::min<uint64_t>(need, UINT32_MAX));
  }
  options.tokenizer = tokenizer.get();
  const parallel::ParallelLayout layout{a.tensor_parallel, a.pipeline_parallel};
  std::unique_ptr<RankGroup> ranks;
  if (layout.tp != 1 || layout.pp != 1) {
    TANDEM_RETURN_IF_ERROR(parallel::CheckLayout(layout, engine::DimsOf(config)));
    if (options.backend != "cpu") {
      return InvalidArgumentError(fmt::format(
          "--tensor-parallel/--pipeline-parallel: backend '{}' has no rank group runtime (cpu only)",
          options.backend));
    }
    options.parallel = layout;
    options.parallel_group = fmt::format("tandem-generate-{}", getpid());
    TANDEM_ASSIGN_OR_RETURN(ranks, RankGroup::Start(model_dir, layout, options.parallel_group,
                                                    options.num_blocks, options.block_size,
                                                    options.threads));
  }
  // A rank that died explains a failure better than what rank 0 saw of it.
  auto with_rank = [&](Status st) {
    if (st.ok() || ranks == nullptr) return st;
    ranks->Finish();
    const std::string death = ranks->death();
    return death.empty() ? st : st.WithContext(death);
  };
  auto created = engine::Engine::Create(config, std::move(weights), options);
  if (!created.ok()) return with_rank(created.status());
  auto eng = std::move(created).value();
  model::ReleaseHostWeights(weights);  // packed copies live in the backend

  engine::GenerateRequest req;
  req.request_id = "generate";
  req.prompt_ids = prompt;
  req.sampling.max_tokens = a.max_tokens;
  req.sampling.temperature = a.temperature;
  req.sampling.seed = a.seed;
  req.sampling.ignore_eos = a.ignore_eos;
  std::vector<uint32_t> out_ids;
  std::string out_text;
  Status final_status;
  req.on_output = [&](const engine::RequestOutput& o) {
    out_ids.insert(out_ids.end(), o.token_ids.begin(), o.token_ids.end());
    out_text += o.text;
    if (!a.json && !o.text.empty()) std::cout << o.text << std::flush;
    if (o.finished) final_status = o.status;
  };
  TANDEM_RETURN_IF_ERROR(with_rank(eng->Submit(std::move(req))));
  eng->RunUntilIdle();
  TANDEM_RETURN_IF_ERROR(with_rank(final_status));
  if (ranks != nullptr) {
    ranks->Finish();
    eng.reset();  // broadcasts the shutdown plan
    TANDEM_RETURN_IF_ERROR(ranks->WaitAll());
  }
  if (a.json) {
    nlohmann::ordered_json j;  // keys in the documented order
    j["token_ids"] = out_ids;
    // Invalid UTF-8 cannot occur (the detokenizer replaces it), but dump
    // defensively rather than throw.
    j["text"] = out_text;
    std::cout << j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
  } else {
    std::cout << "\n";
  }
  return Status::Ok();
}

}  // namespace

void RegisterGenerate(CLI::App& app, GlobalOptions& g) {
  auto* cmd = app.add_subcommand("generate", "Generate in one process, no network");
  auto a = std::make_shared<GenerateArgs>();
  auto* config = cmd->add_option("--config", a->config, "fleet YAML file (its model and cache)");
  auto* model = cmd->add_option("--model", a->model,
                                "Hugging Face model directory (default: the bundled tandem-kjv)");
  config->excludes(model);
  auto* prompt = cmd->add_option("--prompt", a->prompt, "prompt text (tokenized with BOS etc.)");
  auto* ids = cmd->add_option("--prompt-ids", a->prompt_ids, "prompt token ids: 1,2,3");
  prompt->excludes(ids);
  cmd->add_option("--max-tokens", a->max_tokens, "tokens to generate")->required();
  cmd->add_option("--temperature", a->temperature, "0: greedy (default 1.0)");
  cmd->add_option("--seed", a->seed, "sampling seed (default: random)");
  cmd->add_flag("--ignore-eos", a->ignore_eos, "do not stop at end-of-sequence tokens");
  cmd->add_flag("--json", a->json, "print {\"token_ids\": [...], \"text\": \"...\"}");
  cmd->add_option("--tensor-parallel", a->tensor_parallel,
                  "tensor-parallel ranks (CPU processes; default 1)");
  cmd->add_option("--pipeline-parallel", a->pipeline_parallel,
                  "pipeline stages (CPU processes; default 1)");
  cmd->callback([&g, a] {
    if (!a->prompt && !a->prompt_ids) {
      std::cerr << "tandem generate: give --prompt TEXT or --prompt-ids 1,2,3\n";
      g.exit_code = 2;
      return;
    }
    Status st = Run(*a);
    if (!st.ok()) {
      std::cerr << "tandem generate: " << st.message() << "\n";
      g.exit_code = st.code() == StatusCode::kInvalidArgument ? 2 : 1;
      return;
    }
    g.exit_code = 0;
  });
}

}  // namespace tandem::cli
