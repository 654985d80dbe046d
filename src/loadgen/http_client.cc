// One thread per request with Boost.Beast's synchronous client: simple, and
// enough for the concurrency a benchmark on one machine reaches.
#include "loadgen/http_client.h"

#include <fmt/format.h>

#include <atomic>
#include <boost/asio/connect.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

namespace tandem::loadgen {
namespace {

namespace beast = boost::beast;
namespace http = boost::beast::http;
namespace net = boost::asio;
using tcp = net::ip::tcp;
using nlohmann::json;

Status FromHttp(unsigned code, const std::string& body) {
  std::string msg = fmt::format("HTTP {}", code);
  auto j = json::parse(body, nullptr, false);
  if (!j.is_discarded() && j.contains("error") && j["error"].is_object() &&
      j["error"].contains("message") && j["error"]["message"].is_string()) {
    msg += ": " + j["error"]["message"].get<std::string>();
  }
  switch (code) {
    case 400: return InvalidArgumentError(msg);
    case 401: return UnauthenticatedError(msg);
    case 404: return NotFoundError(msg);
    case 413: return InvalidArgumentError(msg);
    case 429: return ResourceExhaustedError(msg);
    case 503: return UnavailableError(msg);
    case 504: return DeadlineExceededError(msg);
    default: return InternalError(msg);
  }
}

class HttpClient final : public Client {
 public:
  explicit HttpClient(HttpClientOptions o) : o_(std::move(o)) {
    const size_t colon = o_.address.rfind(':');
    host_ = colon == std::string::npos ? o_.address : o_.address.substr(0, colon);
    port_ = colon == std::string::npos ? "80" : o_.address.substr(colon + 1);
  }
  ~HttpClient() override {
    std::lock_guard lk(mu_);
    threads_.clear();  // joins
  }

  void Start(Request request, std::function<void(Reply)> done) override {
    std::lock_guard lk(mu_);
    threads_.emplace_back([this, r = std::move(request), done = std::move(done)]() mutable {
      done(Call(r));
    });
  }

  void CancelAll() override { cancel_ = true; }

  Result<ModelInfo> GetModelInfo(const std::string& model) override {
    std::string body;
    unsigned code = 0;
    try {
      net::io_context ioc;
      beast::tcp_stream stream(ioc);
      stream.expires_after(std::chrono::seconds(10));
      stream.connect(tcp::resolver(ioc).resolve(host_, port_));
      http::request<http::empty_body> req{http::verb::get, "/v1/models", 11};
      req.set(http::field::host, host_);
      if (!o_.api_key.empty()) req.set(http::field::authorization, "Bearer " + o_.api_key);
      http::write(stream, req);
      beast::flat_buffer buf;
      http::response<http::string_body> resp;
      http::read(stream, buf, resp);
      body = resp.body();
      code = resp.result_int();
    } catch (const std::exception& e) {
      return UnavailableError(fmt::format("GET http://{}/v1/models: {}", o_.address, e.what()));
    }
    if (code != 200) return FromHttp(code, body).WithContext("GET /v1/models");
    auto j = json::parse(body, nullptr, false);
    if (j.is_discarded() || !j.contains("data") || !j["data"].is_array()) {
      return InternalError(fmt::format("GET http://{}/v1/models: no 'data' list", o_.address));
    }
    for (const auto& m : j["data"]) {
      const std::string id = m.value("id", "");
      if (!model.empty() && id != model) continue;
      ModelInfo info;
      info.id = id;
      info.max_model_len = m.value("max_model_len", 0u);
      info.vocab_size = m.value("vocab_size", o_.vocab_size);
      if (info.vocab_size == 0) {
        return InvalidArgumentError(
            "the HTTP API does not report the model's vocabulary size: pass --vocab-size");
      }
      return info;
    }
    return NotFoundError(fmt::format("http://{} does not serve model '{}'", o_.address, model));
  }

  std::string Describe() const override {
    return "HTTP OpenAI /v1/completions (SSE) at " + o_.address;
  }

 private:
  Reply Call(const Request& r) {
    Reply reply;
    json body = {{"model", r.model},
                 {"prompt", r.prompt_token_ids},
                 {"max_tokens", r.max_tokens},
                 {"ignore_eos", r.ignore_eos},
                 {"stream", true},
                 {"stream_options", {{"include_usage", true}}}};
    if (r.temperature) body["temperature"] = *r.temperature;
    if (r.seed) body["seed"] = *r.seed;
    if (r.priority) body["priority"] = *r.priority;
    std::string pending;  // SSE text not yet split into events
    bool finished = false;
    const auto on_event = [&](std::string_view data) {
      if (data == "[DONE]") {
        finished = true;
        return;
      }
      auto j = json::parse(data, nullptr, false);
      if (j.is_discarded()) return;
      if (j.contains("error") && j["error"].is_object()) {
        reply.status = InternalError("error event: " + j["error"].value("message", std::string()));
        return;
      }
      if (j.contains("choices") && j["choices"].is_array() && !j["choices"].empty()) {
        const json& c = j["choices"][0];
        if (c.contains("text") && c["text"].is_string() && !c["text"].get<std::string>().empty()) {
          reply.chunks.push_back({Clock::now(), 1});
        }
        if (c.contains("finish_reason") && c["finish_reason"].is_string()) {
          reply.finish_reason = c["finish_reason"].get<std::string>();
        }
      }
      if (j.contains("usage") && j["usage"].is_object()) {
        const json& u = j["usage"];
        reply.has_usage = true;
        reply.prompt_tokens = u.value("prompt_tokens", 0u);
        reply.completion_tokens = u.value("completion_tokens", 0u);
        if (u.contains("prompt_tokens_details") && u["prompt_tokens_details"].is_object()) {
          reply.cached_prompt_tokens = u["prompt_tokens_details"].value("cached_tokens", 0u);
        }
      }
    };
    const auto feed = [&](std::string_view bytes) {
      pending.append(bytes.data(), bytes.size());
      size_t end;
      while ((end = pending.find("\n\n")) != std::string::npos) {
        std::string_view ev(pending.data(), end);
        size_t pos = 0;
        while (pos < ev.size()) {
          size_t eol = ev.find('\n', pos);
          if (eol == std::string_view::npos) eol = ev.size();
          std::string_view line = ev.substr(pos, eol - pos);
          if (line.substr(0, 5) == "data:") {
            line.remove_prefix(5);
            if (!line.empty() && line.front() == ' ') line.remove_prefix(1);
            on_event(line);
          }
          pos = eol + 1;
        }
        pending.erase(0, end + 2);
      }
    };
    try {
      net::io_context ioc;
      beast::tcp_stream stream(ioc);
      stream.expires_after(r.timeout);
      stream.connect(tcp::resolver(ioc).resolve(host_, port_));
      http::request<http::string_body> req{http::verb::post, "/v1/completions", 11};
      req.set(http::field::host, host_);
      req.set(http::field::content_type, "application/json");
      const std::string& key = r.api_key.empty() ? o_.api_key : r.api_key;
      if (!key.empty()) req.set(http::field::authorization, "Bearer " + key);
      if (!r.request_id.empty()) req.set("X-Request-Id", r.request_id);
      req.body() = body.dump();
      req.prepare_payload();
      reply.sent = Clock::now();
      http::write(stream, req);
      beast::flat_buffer buf;
      http::response_parser<http::string_body> p;
      p.body_limit(boost::none);
      http::read_header(stream, buf, p);
      const unsigned code = p.get().result_int();
      if (code != 200) {
        http::read(stream, buf, p);
        reply.status = FromHttp(code, p.get().body());
      } else {
        auto cb = [&](std::uint64_t, std::string_view chunk, beast::error_code&) -> std::size_t {
          feed(chunk);
          return chunk.size();
        };
        p.on_chunk_body(cb);
        while (!p.is_done() && !cancel_) http::read_some(stream, buf, p);
        if (!p.get().body().empty()) feed(p.get().body() + "\n\n");  // not chunked
        if (cancel_ && !p.is_done()) reply.status = CancelledError("cancelled");
        else if (reply.status.ok() && !finished) {
          reply.status = DataLossError("the event stream ended without data: [DONE]");
        }
      }
    } catch (const beast::system_error& e) {
      reply.status = e.code() == beast::error::timeout
                         ? DeadlineExceededError("request timed out")
                         : UnavailableError(fmt::format("HTTP {}: {}", o_.address, e.what()));
    } catch (const std::exception& e) {
      reply.status = InternalError(e.what());
    }
    if (reply.sent == Clock::time_point{}) reply.sent = Clock::now();
    reply.done = Clock::now();
    return reply;
  }

  HttpClientOptions o_;
  std::string host_, port_;
  std::atomic<bool> cancel_{false};
  std::mutex mu_;
  std::vector<std::jthread> threads_;
};

}  // namespace

std::unique_ptr<Client> MakeHttpClient(const HttpClientOptions& o) {
  return std::make_unique<HttpClient>(o);
}

}  // namespace tandem::loadgen
