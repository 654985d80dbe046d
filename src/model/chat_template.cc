#include "model/chat_template.h"

#include <fmt/format.h>

#include "model/json_util.h"

namespace tandem::model {
namespace {

// A special token in tokenizer_config.json is a string or {"content": ...}.
std::string TokenText(const nlohmann::json& cfg, const char* key) {
  auto it = cfg.find(key);
  if (it == cfg.end()) return "";
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object() && it->contains("content") && (*it)["content"].is_string()) {
    return (*it)["content"].get<std::string>();
  }
  return "";
}

std::string Trim(std::string_view s) {
  const char* ws = " \t\n\r\f\v";
  const size_t b = s.find_first_not_of(ws);
  if (b == std::string_view::npos) return "";
  const size_t e = s.find_last_not_of(ws);
  return std::string(s.substr(b, e - b + 1));
}

Status CheckRole(const ChatMessage& m, size_t i) {
  if (m.role == "system" || m.role == "user" || m.role == "assistant" || m.role == "developer") {
    return Status::Ok();
  }
  return InvalidArgumentError(fmt::format(
      "messages[{}].role is '{}'; supported roles are system, developer, user and assistant", i,
      m.role));
}

std::string RoleName(const ChatMessage& m) { return m.role == "developer" ? "system" : m.role; }

}  // namespace

Result<ChatTemplateKind> ChatTemplate::Detect(std::string_view jinja) {
  if (jinja.find("<|im_start|>") != std::string_view::npos) return ChatTemplateKind::kChatML;
  if (jinja.find("<|start_header_id|>") != std::string_view::npos) return ChatTemplateKind::kLlama3;
  if (jinja.find("[INST]") != std::string_view::npos) return ChatTemplateKind::kMistral;
  return InvalidArgumentError(
      "the model's chat_template is not one of the families tandem renders (chatml, llama3, "
      "mistral); set proxy.chat_template to the closest one");
}

Result<ChatTemplate> ChatTemplate::FromName(std::string_view name, std::string bos,
                                            std::string eos) {
  if (name == "chatml") return ChatTemplate(ChatTemplateKind::kChatML, bos, eos, "config");
  if (name == "llama3") {
    return ChatTemplate(ChatTemplateKind::kLlama3, bos.empty() ? "<|begin_of_text|>" : bos, eos,
                        "config");
  }
  if (name == "mistral") {
    return ChatTemplate(ChatTemplateKind::kMistral, bos.empty() ? "<s>" : bos,
                        eos.empty() ? "</s>" : eos, "config");
  }
  return InvalidArgumentError(fmt::format(
      "chat template '{}' is unknown; use auto, chatml, llama3 or mistral", name));
}

Result<ChatTemplate> ChatTemplate::Load(const std::string& model_dir, const std::string& name) {
  const std::string path = model_dir + "/tokenizer_config.json";
  nlohmann::json cfg = nlohmann::json::object();
  std::string jinja;
  auto parsed = internal::ReadJsonFile(path);
  if (parsed.ok() && parsed->is_object()) {
    cfg = std::move(parsed).value();
    auto it = cfg.find("chat_template");
    if (it != cfg.end()) {
      if (it->is_string()) {
        jinja = it->get<std::string>();
      } else if (it->is_array()) {  // [{"name": "default", "template": "..."}, ...]
        for (const auto& t : *it) {
          if (t.is_object() && t.value("name", "") == "default" && t.contains("template") &&
              t["template"].is_string()) {
            jinja = t["template"].get<std::string>();
          }
        }
      }
    }
  }
  const std::string bos = TokenText(cfg, "bos_token");
  const std::string eos = TokenText(cfg, "eos_token");
  if (name != "auto") return FromName(name, bos, eos);
  if (jinja.empty()) {
    return NotFoundError(fmt::format(
        "{} has no chat_template; set proxy.chat_template (chatml, llama3 or mistral)", path));
  }
  auto kind = Detect(jinja);
  if (!kind.ok()) return InvalidArgumentError(fmt::format("{}: {}", path, kind.status().message()));
  ChatTemplate t(*kind, bos, eos, "tokenizer_config.json");
  if (t.kind_ == ChatTemplateKind::kLlama3 && t.bos_.empty()) t.bos_ = "<|begin_of_text|>";
  if (t.kind_ == ChatTemplateKind::kMistral) {
    if (t.bos_.empty()) t.bos_ = "<s>";
    if (t.eos_.empty()) t.eos_ = "</s>";
  }
  return t;
}

std::string_view ChatTemplate::name() const {
  switch (kind_) {
    case ChatTemplateKind::kChatML: return "chatml";
    case ChatTemplateKind::kLlama3: return "llama3";
    case ChatTemplateKind::kMistral: return "mistral";
  }
  return "?";
}

Result<std::string> ChatTemplate::Render(const std::vector<ChatMessage>& messages,
                                         bool add_generation_prompt) const {
  if (messages.empty()) return InvalidArgumentError("messages is empty; give at least one message");
  for (size_t i = 0; i < messages.size(); ++i) TANDEM_RETURN_IF_ERROR(CheckRole(messages[i], i));
  std::string out;
  switch (kind_) {
    case ChatTemplateKind::kChatML:
      for (const auto& m : messages) {
        out += "<|im_start|>" + RoleName(m) + "\n" + m.content + "<|im_end|>\n";
      }
      if (add_generation_prompt) out += "<|im_start|>assistant\n";
      break;
    case ChatTemplateKind::kLlama3:
      out = bos_;
      for (const auto& m : messages) {
        out += "<|start_header_id|>" + RoleName(m) + "<|end_header_id|>\n\n" + Trim(m.content) +
               "<|eot_id|>";
      }
      if (add_generation_prompt) out += "<|start_header_id|>assistant<|end_header_id|>\n\n";
      break;
    case ChatTemplateKind::kMistral: {
      // A leading system message is folded into the first user turn; the
      // rest must alternate user, assistant, user, ...
      size_t first = 0;
      std::string system;
      if (RoleName(messages[0]) == "system") {
        system = messages[0].content;
        first = 1;
      }
      out = bos_;
      for (size_t i = first; i < messages.size(); ++i) {
        const auto& m = messages[i];
        const bool want_user = (i - first) % 2 == 0;
        const std::string role = RoleName(m);
        if (role != (want_user ? "user" : "assistant")) {
          return InvalidArgumentError(fmt::format(
              "messages[{}].role is '{}'; this model's template (mistral) needs turns that "
              "alternate user/assistant after an optional first system message",
              i, m.role));
        }
        if (want_user) {
          std::string content = m.content;
          if (i == first && !system.empty()) content = system + "\n\n" + content;
          out += "[INST] " + content + " [/INST]";
        } else {
          out += m.content + eos_;
        }
      }
      break;
    }
  }
  return out;
}

}  // namespace tandem::model
