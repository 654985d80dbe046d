// `tandem certs --dir DIR --name NAME [--host H]...` (docs/security.md):
// issues NAME.pem/NAME.key signed by the CA in DIR (created, mode 0700, when
// DIR has none) for the given hosts, and prints the three files. For
// processes started by hand (a worker joining a launched fleet uses DIR =
// the launch's security_dir + "/internal") and for renewing the public
// certificate (then SIGHUP the proxy).
#include <fmt/format.h>

#include <iostream>

#include "cli/commands.h"
#include "common/tls_certs.h"

namespace tandem::cli {

void RegisterCerts(CLI::App& app, GlobalOptions& g) {
  auto* cmd = app.add_subcommand("certs", "Issue a certificate of a tandem CA (created if absent)");
  auto dir = std::make_shared<std::string>();
  auto name = std::make_shared<std::string>();
  auto hosts = std::make_shared<std::vector<std::string>>();
  cmd->add_option("--dir", *dir, "the CA's directory (ca.pem, ca.key), e.g. STATE-tls/internal")
      ->required();
  cmd->add_option("--name", *name, "the identity (certificate common name), e.g. decode-7")
      ->required();
  cmd->add_option("--host", *hosts,
                  "a host its listeners are reached at (IP or DNS name; repeatable; default "
                  "127.0.0.1 and localhost)");
  cmd->callback([&g, dir, name, hosts] {
    auto ca = FleetCa::OpenOrCreate(*dir, "tandem fleet CA");
    auto files = ca.ok() ? ca->Issue(*name, hosts->empty() ? std::vector<std::string>{"127.0.0.1", "localhost"}
                                                           : *hosts)
                         : Result<TlsFiles>(ca.status());
    if (!files.ok()) {
      std::cerr << "tandem certs: " << files.status().message() << "\n";
      g.exit_code = 1;
      return;
    }
    std::cout << fmt::format("--tls-ca {} --tls-cert {} --tls-key {}\n", files->ca_file,
                             files->cert_file, files->key_file);
    g.exit_code = 0;
  });
}

}  // namespace tandem::cli
