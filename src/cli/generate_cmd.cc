// `tandem generate`: one process, no network (DESIGN.md section 7).
//
//   tandem generate [--config FILE | --model DIR] (--prompt TEXT | --prompt-ids 1,2,3)
//                   --max-tokens N [--temperature T] [--seed S] [--ignore-eos] [--json]
//
// Streams the completion's text to stdout as it is generated; with --json
// prints {"token_ids": [...], "text": "..."} of the completion only.
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <iostream>
#include <optional>
#include <sstream>

#include "cli/commands.h"
#include "common/config.h"
#include "engine/engine.h"
#include "model/model_config.h"
#include "model/tokenizer.h"
#include "model/weights.h"

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
  TANDEM_ASSIGN_OR_RETURN(auto eng, engine::Engine::Create(config, weights, options));
  weights = {};  // packed copies live in the backend

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
  TANDEM_RETURN_IF_ERROR(eng->Submit(std::move(req)));
  eng->RunUntilIdle();
  TANDEM_RETURN_IF_ERROR(final_status);
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
