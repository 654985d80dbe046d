// Tokenizer::Load and the byte-level BPE tokenizer behind it.
#include "model/tokenizer.h"

#include <algorithm>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>

#include "model/added_vocabulary.h"
#include "model/bpe.h"
#include "model/json_util.h"
#include "model/pre_tokenizer.h"
#include "model/utf8.h"

namespace tandem::model {
namespace {

using internal::AddedVocabulary;
using internal::BpeModel;
using internal::PreTokenizer;

// What add_special_tokens puts around a single sequence.
struct PostProcessor {
  std::vector<uint32_t> prefix_ids;
  std::vector<uint32_t> suffix_ids;
};

Result<PostProcessor> ParsePostProcessor(const nlohmann::json& c) {
  PostProcessor pp;
  if (c.is_null()) return pp;
  const std::string type = c.value("type", std::string());
  if (type == "ByteLevel") return pp;  // offsets only
  if (type == "Sequence") {
    for (const auto& sub : c.value("processors", nlohmann::json::array())) {
      TANDEM_ASSIGN_OR_RETURN(PostProcessor inner, ParsePostProcessor(sub));
      // A later processor wraps what the earlier ones produced.
      inner.prefix_ids.insert(inner.prefix_ids.end(), pp.prefix_ids.begin(), pp.prefix_ids.end());
      pp.suffix_ids.insert(pp.suffix_ids.end(), inner.suffix_ids.begin(), inner.suffix_ids.end());
      pp.prefix_ids = std::move(inner.prefix_ids);
    }
    return pp;
  }
  if (type == "TemplateProcessing") {
    const auto& specials = c.value("special_tokens", nlohmann::json::object());
    bool seen_sequence = false;
    for (const auto& item : c.value("single", nlohmann::json::array())) {
      if (item.contains("Sequence")) {
        if (item["Sequence"].value("id", std::string()) != "A") {
          return InvalidArgumentError("post_processor: single template uses a sequence other "
                                      "than $A");
        }
        seen_sequence = true;
      } else if (item.contains("SpecialToken")) {
        const std::string name = item["SpecialToken"].value("id", std::string());
        auto it = specials.find(name);
        if (it == specials.end() || !it->contains("ids") || !(*it)["ids"].is_array()) {
          return InvalidArgumentError("post_processor: special token '" + name +
                                      "' is not in special_tokens");
        }
        auto& dst = seen_sequence ? pp.suffix_ids : pp.prefix_ids;
        for (const auto& id : (*it)["ids"]) dst.push_back(id.get<uint32_t>());
      } else {
        return InvalidArgumentError("post_processor: unknown template item " + item.dump());
      }
    }
    return pp;
  }
  if (type == "RobertaProcessing" || type == "BertProcessing") {
    pp.prefix_ids.push_back(c.at("cls").at(1).get<uint32_t>());
    pp.suffix_ids.push_back(c.at("sep").at(1).get<uint32_t>());
    return pp;
  }
  return UnimplementedError("post_processor type '" + type + "' is not supported");
}

Status CheckNormalizer(const nlohmann::json& n) {
  if (n.is_null()) return Status::Ok();
  const std::string type = n.value("type", std::string());
  // NFC (Qwen2) is accepted but not applied: text is assumed to arrive in
  // NFC already, which holds for almost all real input; tandem carries no
  // Unicode composition tables.
  if (type == "NFC") return Status::Ok();
  if (type == "Sequence") {
    for (const auto& sub : n.value("normalizers", nlohmann::json::array())) {
      TANDEM_RETURN_IF_ERROR(CheckNormalizer(sub));
    }
    return Status::Ok();
  }
  return UnimplementedError("normalizer type '" + type + "' is not supported");
}

Status CheckDecoder(const nlohmann::json& d) {
  // A missing decoder is read as byte-level too: the model is byte-level.
  if (d.is_null()) return Status::Ok();
  const std::string type = d.value("type", std::string());
  if (type == "ByteLevel") return Status::Ok();
  if (type == "Sequence") {
    for (const auto& sub : d.value("decoders", nlohmann::json::array())) {
      TANDEM_RETURN_IF_ERROR(CheckDecoder(sub));
    }
    return Status::Ok();
  }
  return UnimplementedError("decoder type '" + type + "' is not supported (ByteLevel)");
}

class BpeTokenizer final : public Tokenizer {
 public:
  static Result<std::unique_ptr<Tokenizer>> Create(const nlohmann::json& j) {
    std::unique_ptr<BpeTokenizer> t(new BpeTokenizer());
    if (!j.is_object()) return InvalidArgumentError("not a JSON object");
    try {
      TANDEM_RETURN_IF_ERROR(CheckNormalizer(j.value("normalizer", nlohmann::json())));
      TANDEM_RETURN_IF_ERROR(CheckDecoder(j.value("decoder", nlohmann::json())));
      TANDEM_ASSIGN_OR_RETURN(t->added_,
                              AddedVocabulary::Create(j.value("added_tokens", nlohmann::json())));
      TANDEM_ASSIGN_OR_RETURN(t->pre_,
                              PreTokenizer::Create(j.value("pre_tokenizer", nlohmann::json())));
      if (!j.contains("model")) return InvalidArgumentError("missing 'model'");
      TANDEM_ASSIGN_OR_RETURN(t->bpe_, BpeModel::Create(j["model"]));
      TANDEM_ASSIGN_OR_RETURN(t->post_,
                              ParsePostProcessor(j.value("post_processor", nlohmann::json())));
    } catch (const nlohmann::json::exception& e) {
      return InvalidArgumentError(e.what());
    }
    // Bytes of every id, as Hugging Face's ByteLevel decoder produces them
    // (added tokens go through the same decoder).
    const auto& model_tokens = t->bpe_->id_to_token();
    size_t n = model_tokens.size();
    for (const auto& a : t->added_->tokens()) n = std::max<size_t>(n, a.id + 1);
    std::vector<std::string> id_bytes(n);
    std::vector<bool> is_special(n, false);
    for (size_t id = 0; id < model_tokens.size(); ++id) {
      id_bytes[id] = internal::ByteLevelDecode(model_tokens[id]);
    }
    for (const auto& a : t->added_->tokens()) {
      id_bytes[a.id] = internal::ByteLevelDecode(a.content);
      is_special[a.id] = a.special;
    }
    t->table_.entries.reserve(n);
    for (size_t id = 0; id < n; ++id) {
      if (!t->table_.Add(id_bytes[id], is_special[id])) {
        return InvalidArgumentError("token id " + std::to_string(id) + " has " +
                                    std::to_string(id_bytes[id].size()) +
                                    " bytes; the vocabulary's table takes tokens under 1 GiB and "
                                    "at most 4 GiB of bytes in all");
      }
    }
    for (uint32_t id : t->post_.prefix_ids) {
      if (id >= n) return InvalidArgumentError("post_processor uses unknown id " + std::to_string(id));
    }
    for (uint32_t id : t->post_.suffix_ids) {
      if (id >= n) return InvalidArgumentError("post_processor uses unknown id " + std::to_string(id));
    }
    return std::unique_ptr<Tokenizer>(std::move(t));
  }

  std::vector<uint32_t> Encode(std::string_view text, bool add_special_tokens) const override {
    std::string cleaned;
    if (!IsValidUtf8(text)) {
      // PCRE2 in UTF mode needs valid input; Hugging Face only takes valid
      // strings, so invalid bytes become U+FFFD first.
      cleaned = internal::SanitizeUtf8(text);
      text = cleaned;
    }
    std::vector<uint32_t> ids;
    if (add_special_tokens) ids = post_.prefix_ids;
    std::vector<AddedVocabulary::Piece> pieces;
    added_->Split(text, &pieces);
    std::vector<std::string> words;
    for (const auto& piece : pieces) {
      if (piece.id) {
        ids.push_back(*piece.id);
        continue;
      }
      words.clear();
      pre_->Run(piece.text, &words);
      for (const std::string& w : words) bpe_->Tokenize(w, &ids);
    }
    if (add_special_tokens) ids.insert(ids.end(), post_.suffix_ids.begin(), post_.suffix_ids.end());
    return ids;
  }

  std::string Decode(std::span<const uint32_t> ids, bool skip_special_tokens) const override {
    std::string out;
    for (uint32_t id : ids) AppendTokenBytes(id, skip_special_tokens, &out);
    return out;
  }

  std::string TokenBytes(uint32_t id) const override {
    if (id >= table_.entries.size()) return std::string();
    return std::string(table_.Bytes(table_.entries[id]));
  }
  bool IsSpecial(uint32_t id) const override {
    return id < table_.entries.size() && table_.entries[id].special;
  }
  void AppendTokenBytes(uint32_t id, bool skip_special, std::string* out) const override {
    if (id >= table_.entries.size()) return;
    const TokenBytesTable::Entry& e = table_.entries[id];
    if (!(skip_special && e.special)) out->append(table_.Bytes(e));
  }
  const TokenBytesTable* token_table() const override { return &table_; }
  uint32_t vocab_size() const override { return static_cast<uint32_t>(table_.entries.size()); }
  std::optional<uint32_t> TokenToId(std::string_view token) const override {
    if (auto id = added_->FindByContent(token)) return id;
    return bpe_->TokenToId(token);
  }

 private:
  BpeTokenizer() = default;
  std::unique_ptr<AddedVocabulary> added_;
  std::unique_ptr<PreTokenizer> pre_;
  std::unique_ptr<BpeModel> bpe_;
  PostProcessor post_;
  TokenBytesTable table_;  // every id's bytes
};

}  // namespace

bool TokenBytesTable::Add(std::string_view token_bytes, bool special) {
  if (token_bytes.size() >= (size_t{1} << 30) ||
      bytes.size() + token_bytes.size() > std::numeric_limits<uint32_t>::max()) {
    return false;
  }
  Entry e;
  e.offset = static_cast<uint32_t>(bytes.size());
  e.size = static_cast<uint32_t>(token_bytes.size()) & ((1u << 30) - 1);
  e.ascii = std::all_of(token_bytes.begin(), token_bytes.end(),
                        [](char c) { return static_cast<uint8_t>(c) < 0x80; });
  e.special = special;
  entries.push_back(e);
  bytes.append(token_bytes);
  return true;
}

Result<std::unique_ptr<Tokenizer>> Tokenizer::Load(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  std::string file = path;
  if (fs::is_directory(path, ec)) file = (fs::path(path) / "tokenizer.json").string();
  TANDEM_ASSIGN_OR_RETURN(nlohmann::json j, internal::ReadJsonFile(file));
  auto t = BpeTokenizer::Create(j);
  if (!t.ok()) return t.status().WithContext(file);
  return t;
}

}  // namespace tandem::model
