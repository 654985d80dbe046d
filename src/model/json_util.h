// Small helpers for reading Hugging Face JSON files (config.json,
// tokenizer.json, safetensors headers) without letting nlohmann exceptions
// escape: every failure becomes a Status naming the file and the key.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "common/status.h"

namespace tandem::model::internal {

// Reads and parses a whole JSON file.
Result<nlohmann::json> ReadJsonFile(const std::string& path);
// Parses JSON text; `what` names the source in errors.
Result<nlohmann::json> ParseJson(std::string_view text, const std::string& what);

// Reads whole file into a string.
Result<std::string> ReadFile(const std::string& path);

// Typed getters. `file` is used in error messages ("config.json: 'x' ...").
// Absent or null keys give std::nullopt; a value of the wrong type is an error.
Result<std::optional<uint64_t>> OptUint(const nlohmann::json& j, const char* key,
                                        const std::string& file);
Result<std::optional<double>> OptDouble(const nlohmann::json& j, const char* key,
                                        const std::string& file);
Result<std::optional<bool>> OptBool(const nlohmann::json& j, const char* key,
                                    const std::string& file);
Result<std::optional<std::string>> OptString(const nlohmann::json& j, const char* key,
                                             const std::string& file);
// Required unsigned integer in [1, 2^32).
Result<uint32_t> RequiredPositiveU32(const nlohmann::json& j, const char* key,
                                     const std::string& file);

}  // namespace tandem::model::internal
