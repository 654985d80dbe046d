// `tandem client`: streams one completion from a running fleet over the
// public gRPC API (tandem.v1.Generation) and prints the text as it arrives.
#include <fmt/format.h>
#include <grpcpp/grpcpp.h>

#include <iostream>

#include "cli/commands.h"
#include "common/tls.h"
#include "tandem/v1/generation.grpc.pb.h"

namespace tandem::cli {
namespace {

struct ClientArgs {
  std::string proxy = "127.0.0.1:50051";
  std::string prompt;
  uint32_t max_tokens = 64;
  float temperature = 0.0f;
  uint64_t seed = 0;
  bool has_seed = false;
  std::string api_key;
  std::string tls_ca;  // public_tls: verify the proxy against this CA
};

int RunClient(const ClientArgs& a) {
  std::shared_ptr<grpc::ChannelCredentials> creds = grpc::InsecureChannelCredentials();
  if (!a.tls_ca.empty()) {
    auto pem = ReadTlsFiles({a.tls_ca, "", ""});
    if (!pem.ok()) {
      std::cerr << "tandem client: --tls-ca: " << pem.status().message() << "\n";
      return 1;
    }
    grpc::SslCredentialsOptions o;
    o.pem_root_certs = pem->ca;
    creds = grpc::SslCredentials(o);
  }
  auto stub = v1::Generation::NewStub(grpc::CreateChannel(a.proxy, creds));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::minutes(5));
  if (!a.api_key.empty()) ctx.AddMetadata("authorization", "Bearer " + a.api_key);
  v1::GenerateRequest req;
  req.set_prompt(a.prompt);
  req.set_max_tokens(a.max_tokens);
  req.mutable_sampling()->set_temperature(a.temperature);
  if (a.has_seed) req.mutable_sampling()->set_seed(a.seed);
  auto reader = stub->Generate(&ctx, req);
  v1::GenerateResponse resp;
  v1::Usage usage;
  while (reader->Read(&resp)) {
    std::cout << resp.text() << std::flush;
    if (resp.has_usage()) usage = resp.usage();
  }
  const grpc::Status st = reader->Finish();
  std::cout << "\n";
  if (!st.ok()) {
    std::cerr << fmt::format("error {}: {}\n", static_cast<int>(st.error_code()),
                             st.error_message());
    return 1;
  }
  std::cerr << fmt::format("[{} prompt tokens ({} cached), {} completion tokens]\n",
                           usage.prompt_tokens(), usage.cached_prompt_tokens(),
                           usage.completion_tokens());
  return 0;
}

}  // namespace

void RegisterClient(CLI::App& app, GlobalOptions& g) {
  auto* cmd = app.add_subcommand("client", "Stream one completion from a running fleet (gRPC)");
  auto a = std::make_shared<ClientArgs>();
  cmd->add_option("--proxy", a->proxy, "proxy gRPC address (default 127.0.0.1:50051)");
  cmd->add_option("--prompt", a->prompt, "prompt text")->required();
  cmd->add_option("--max-tokens", a->max_tokens, "tokens to generate (default 64)");
  cmd->add_option("--temperature", a->temperature, "0 = greedy (default)");
  cmd->add_option("--api-key", a->api_key, "sent as 'authorization: Bearer KEY'");
  cmd->add_option("--tls-ca", a->tls_ca,
                  "TLS: verify the proxy against this CA (the state file's public_ca_file)");
  auto* seed = cmd->add_option("--seed", a->seed, "sampling seed");
  cmd->callback([&g, a, seed] {
    a->has_seed = seed->count() > 0;
    g.exit_code = RunClient(*a);
  });
}

}  // namespace tandem::cli
