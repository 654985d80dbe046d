// Chat templates: turns OpenAI-style chat messages into the prompt text a
// model was trained on. tandem does not run Jinja; it recognizes the common
// template families in a model's tokenizer_config.json `chat_template` and
// renders them with a small fixed renderer:
//   chatml  — <|im_start|>ROLE\nCONTENT<|im_end|>\n ... (Qwen, Qwen2, many
//             fine-tunes, the bundled model)
//   llama3  — <|begin_of_text|><|start_header_id|>ROLE<|end_header_id|>\n\n
//             CONTENT<|eot_id|> ... (Llama 3 / 3.1 / 3.2, without 3.1's tool
//             and date preamble)
//   mistral — <s>[INST] USER [/INST]ASSISTANT</s>... (Mistral / Mixtral
//             instruct; a system message is prepended to the first user turn)
// Supported behaviour and its limits: docs/http-api.md.
//
// Thread-safety: a loaded ChatTemplate is immutable.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace tandem::model {

enum class ChatTemplateKind { kChatML, kLlama3, kMistral };

struct ChatMessage {
  std::string role;  // system | user | assistant (developer is taken as system)
  std::string content;
};

class ChatTemplate {
 public:
  // `name` is "auto" (detect from MODEL_DIR/tokenizer_config.json's
  // chat_template) or one of "chatml", "llama3", "mistral". NOT_FOUND when
  // "auto" finds no template; INVALID_ARGUMENT when it finds one of a family
  // tandem cannot render (the message says to set proxy.chat_template).
  static Result<ChatTemplate> Load(const std::string& model_dir, const std::string& name);
  // From a family name; `bos`/`eos` are the model's special token texts.
  static Result<ChatTemplate> FromName(std::string_view name, std::string bos = "",
                                       std::string eos = "");
  // Recognizes the family of a Jinja template's text.
  static Result<ChatTemplateKind> Detect(std::string_view jinja);

  // The prompt text (special tokens written as text, e.g. "<|im_start|>", to
  // be encoded without adding a BOS: templates that want one write it).
  // INVALID_ARGUMENT names messages[i].role when a role is not allowed or
  // (mistral) turns do not alternate user/assistant.
  Result<std::string> Render(const std::vector<ChatMessage>& messages,
                             bool add_generation_prompt = true) const;

  ChatTemplateKind kind() const { return kind_; }
  std::string_view name() const;
  // Where the choice came from: "tokenizer_config.json" or "config".
  const std::string& origin() const { return origin_; }

 private:
  ChatTemplate(ChatTemplateKind kind, std::string bos, std::string eos, std::string origin)
      : kind_(kind), bos_(std::move(bos)), eos_(std::move(eos)), origin_(std::move(origin)) {}

  ChatTemplateKind kind_;
  std::string bos_;
  std::string eos_;
  std::string origin_;
};

}  // namespace tandem::model
