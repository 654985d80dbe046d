#include "loadgen/mooncake_trace.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

namespace tandem::loadgen {
namespace {

using nlohmann::json;

// A non-negative integer field of `obj`; the error names line and field.
Result<uint64_t> UIntField(const json& obj, const char* field, const std::string& where,
                           uint64_t max) {
  auto it = obj.find(field);
  if (it == obj.end()) {
    return InvalidArgumentError(fmt::format("{}: missing field '{}'", where, field));
  }
  // nlohmann parses every non-negative integer literal as unsigned.
  if (!it->is_number_unsigned()) {
    return InvalidArgumentError(fmt::format(
        "{}: field '{}' must be a non-negative integer, got {}", where, field, it->dump()));
  }
  const uint64_t v = it->get<uint64_t>();
  if (v > max) {
    return InvalidArgumentError(
        fmt::format("{}: field '{}' is {}; the limit is {}", where, field, v, max));
  }
  return v;
}

}  // namespace

Result<std::vector<TraceRecord>> ParseMooncakeTrace(const std::string& text,
                                                    const std::string& name,
                                                    size_t max_records) {
  std::vector<TraceRecord> out;
  std::istringstream in(text);
  std::string line;
  uint32_t line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    if (max_records > 0 && out.size() >= max_records) break;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = fmt::format("{}:{}", name, line_no);
    json obj = json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (obj.is_discarded()) {
      return InvalidArgumentError(fmt::format("{}: not valid JSON", where));
    }
    if (!obj.is_object()) {
      return InvalidArgumentError(fmt::format("{}: expected a JSON object", where));
    }
    TraceRecord r;
    r.line = line_no;
    TANDEM_ASSIGN_OR_RETURN(r.timestamp_ms, UIntField(obj, "timestamp", where, 1ULL << 50));
    TANDEM_ASSIGN_OR_RETURN(uint64_t in_len, UIntField(obj, "input_length", where, 100'000'000));
    TANDEM_ASSIGN_OR_RETURN(uint64_t out_len,
                            UIntField(obj, "output_length", where, 100'000'000));
    if (in_len == 0) {
      return InvalidArgumentError(fmt::format("{}: field 'input_length' must be >= 1", where));
    }
    if (out_len == 0) {
      return InvalidArgumentError(fmt::format("{}: field 'output_length' must be >= 1", where));
    }
    r.input_length = uint32_t(in_len);
    r.output_length = uint32_t(out_len);
    auto ids = obj.find("hash_ids");
    if (ids == obj.end()) {
      return InvalidArgumentError(fmt::format("{}: missing field 'hash_ids'", where));
    }
    if (!ids->is_array()) {
      return InvalidArgumentError(
          fmt::format("{}: field 'hash_ids' must be an array of integers", where));
    }
    for (size_t i = 0; i < ids->size(); ++i) {
      const json& v = (*ids)[i];
      if (!v.is_number_unsigned()) {
        return InvalidArgumentError(fmt::format(
            "{}: field 'hash_ids[{}]' must be a non-negative integer, got {}", where, i, v.dump()));
      }
      r.hash_ids.push_back(v.get<uint64_t>());
    }
    const uint64_t need = (in_len + kMooncakeBlockTokens - 1) / kMooncakeBlockTokens;
    if (r.hash_ids.size() != need) {
      return InvalidArgumentError(fmt::format(
          "{}: field 'hash_ids' has {} ids; input_length {} needs {} (blocks of {} tokens)", where,
          r.hash_ids.size(), in_len, need, kMooncakeBlockTokens));
    }
    if (!out.empty() && r.timestamp_ms < out.back().timestamp_ms) {
      return InvalidArgumentError(fmt::format(
          "{}: field 'timestamp' {} is earlier than line {}'s {} (the trace must be in time order)",
          where, r.timestamp_ms, out.back().line, out.back().timestamp_ms));
    }
    out.push_back(std::move(r));
  }
  if (out.empty()) return InvalidArgumentError(fmt::format("{}: no requests in the trace", name));
  return out;
}

Result<std::vector<TraceRecord>> ReadMooncakeTrace(const std::string& path, size_t max_records) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return NotFoundError(fmt::format("cannot open trace file '{}'", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return ParseMooncakeTrace(ss.str(), path, max_records);
}

std::vector<uint32_t> HashBlockTokens(uint64_t hash_id, uint32_t n, uint32_t vocab) {
  // A fixed odd constant keeps hash block ids apart from synthetic seeds.
  return SeededTokens(hash_id * 0x2545f4914f6cdd1dULL + 0x6d6f6f6e63616b65ULL, n, vocab);
}

uint32_t ScaledInputLength(uint32_t input_length, uint32_t block_tokens) {
  return uint32_t((uint64_t(input_length) * block_tokens + kMooncakeBlockTokens - 1) /
                  kMooncakeBlockTokens);
}

Result<TraceReplay> BuildTraceReplay(const std::vector<TraceRecord>& records,
                                     const TraceReplayOptions& o) {
  if (o.block_tokens < 1 || o.block_tokens > kMooncakeBlockTokens) {
    return InvalidArgumentError(fmt::format("--trace-block-tokens must be in [1, {}], got {}",
                                            kMooncakeBlockTokens, o.block_tokens));
  }
  if (!(o.output_scale > 0) || o.output_scale > 1000) {
    return InvalidArgumentError(
        fmt::format("--trace-output-scale must be in (0, 1000], got {}", o.output_scale));
  }
  if (!(o.time_scale >= 0) || o.time_scale > 1e6) {
    return InvalidArgumentError(
        fmt::format("--time-scale must be in [0, 1000000], got {}", o.time_scale));
  }
  if (o.vocab <= kFirstTokenId) {
    return InvalidArgumentError(fmt::format("the model's vocabulary ({}) is too small", o.vocab));
  }
  TraceReplay r;
  const uint64_t t0 = records.empty() ? 0 : records.front().timestamp_ms;
  for (size_t i = 0; i < records.size(); ++i) {
    const TraceRecord& rec = records[i];
    Session s;
    s.id = i;
    s.start_s = double(rec.timestamp_ms - t0) / 1000.0 * o.time_scale;
    Turn t;
    t.max_tokens =
        std::max<uint32_t>(1, uint32_t(std::lround(double(rec.output_length) * o.output_scale)));
    uint32_t in_len = ScaledInputLength(rec.input_length, o.block_tokens);
    if (o.max_model_len > 0) {
      if (t.max_tokens >= o.max_model_len) {
        t.max_tokens = std::max<uint32_t>(1, o.max_model_len / 2);
        ++r.clamped_outputs;
      }
      if (uint64_t(in_len) + t.max_tokens > o.max_model_len) {
        in_len = o.max_model_len - t.max_tokens;
        ++r.truncated_prompts;
      }
    }
    t.new_tokens.reserve(in_len);
    for (uint64_t id : rec.hash_ids) {
      if (t.new_tokens.size() >= in_len) break;
      const uint32_t n = std::min<uint32_t>(o.block_tokens, in_len - uint32_t(t.new_tokens.size()));
      auto block = HashBlockTokens(id, o.block_tokens, o.vocab);
      t.new_tokens.insert(t.new_tokens.end(), block.begin(), block.begin() + n);
    }
    s.turns.push_back(std::move(t));
    r.sessions.push_back(std::move(s));
  }
  r.description = fmt::format(
      "Mooncake trace replay: {} requests, hash blocks of {} tokens (input lengths x {}/{}), "
      "output lengths x {}, timestamps x {}; {} prompts truncated to the context, {} outputs "
      "clamped",
      records.size(), o.block_tokens, o.block_tokens, kMooncakeBlockTokens, o.output_scale,
      o.time_scale, r.truncated_prompts, r.clamped_outputs);
  return r;
}

}  // namespace tandem::loadgen
