#include "model/json_util.h"

#include <fstream>
#include <sstream>

namespace tandem::model::internal {

Result<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return NotFoundError(path + ": cannot open file");
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return DataLossError(path + ": read error");
  return ss.str();
}

Result<nlohmann::json> ParseJson(std::string_view text, const std::string& what) {
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return InvalidArgumentError(what + ": not valid JSON");
  return j;
}

Result<nlohmann::json> ReadJsonFile(const std::string& path) {
  TANDEM_ASSIGN_OR_RETURN(std::string text, ReadFile(path));
  return ParseJson(text, path);
}

namespace {
Status WrongType(const char* key, const std::string& file, const char* want,
                 const nlohmann::json& v) {
  return InvalidArgumentError(file + ": '" + key + "' must be " + want + ", got " + v.dump());
}
}  // namespace

Result<std::optional<uint64_t>> OptUint(const nlohmann::json& j, const char* key,
                                        const std::string& file) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return std::optional<uint64_t>();
  if (it->is_number_unsigned()) return std::optional<uint64_t>(it->get<uint64_t>());
  if (it->is_number_integer() && it->get<int64_t>() >= 0) {
    return std::optional<uint64_t>(static_cast<uint64_t>(it->get<int64_t>()));
  }
  return WrongType(key, file, "a non-negative integer", *it);
}

Result<std::optional<double>> OptDouble(const nlohmann::json& j, const char* key,
                                        const std::string& file) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return std::optional<double>();
  if (it->is_number()) return std::optional<double>(it->get<double>());
  return WrongType(key, file, "a number", *it);
}

Result<std::optional<bool>> OptBool(const nlohmann::json& j, const char* key,
                                    const std::string& file) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return std::optional<bool>();
  if (it->is_boolean()) return std::optional<bool>(it->get<bool>());
  return WrongType(key, file, "true or false", *it);
}

Result<std::optional<std::string>> OptString(const nlohmann::json& j, const char* key,
                                             const std::string& file) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return std::optional<std::string>();
  if (it->is_string()) return std::optional<std::string>(it->get<std::string>());
  return WrongType(key, file, "a string", *it);
}

Result<uint32_t> RequiredPositiveU32(const nlohmann::json& j, const char* key,
                                     const std::string& file) {
  TANDEM_ASSIGN_OR_RETURN(std::optional<uint64_t> v, OptUint(j, key, file));
  if (!v) return InvalidArgumentError(file + ": missing required key '" + key + "'");
  if (*v == 0 || *v > UINT32_MAX) {
    return InvalidArgumentError(file + ": '" + key + "' must be in [1, 4294967295], got " +
                                std::to_string(*v));
  }
  return static_cast<uint32_t>(*v);
}

}  // namespace tandem::model::internal
