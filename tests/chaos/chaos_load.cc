#include "chaos_load.h"

#include <fmt/format.h>
#include <grpcpp/grpcpp.h>

#include <random>

#include "tandem/v1/generation.grpc.pb.h"

namespace tandem::testing::chaos {

namespace pb = ::tandem::v1;

Result<std::vector<Job>> MakeJobs(int n, uint32_t seed) {
  constexpr uint32_t kVocab = 4096;
  std::mt19937 rng(seed);
  std::vector<Job> jobs;
  for (int i = 0; i < n; ++i) {
    Job j;
    // Mixed lengths: short prompts (one chunk) to long ones (4 chunks of 128).
    const uint32_t len = 16 + rng() % 400;
    j.prompt = PromptIds(seed * 1000 + static_cast<uint32_t>(i), len, kVocab);
    j.max_tokens = 8 + rng() % 89;
    if (i % 2 == 1) {
      j.temperature = 0.8f;
      j.seed = 90000 + seed * 1000 + static_cast<uint64_t>(i);
    }
    auto ref = j.temperature == 0 ? ReferenceGenerate(j.prompt, j.max_tokens)
                                  : ReferenceGenerate(j.prompt, j.max_tokens, j.temperature, j.seed);
    if (!ref.ok()) return ref.status();
    if (ref->size() != j.max_tokens) {
      return InternalError(fmt::format("tandem generate gave {} tokens, asked {}", ref->size(),
                                       j.max_tokens));
    }
    j.expected = *ref;
    jobs.push_back(std::move(j));
  }
  return jobs;
}

Load::Load(std::string proxy, const std::vector<Job>& jobs, int streams,
           std::chrono::milliseconds deadline, int max_per_stream)
    : proxy_(std::move(proxy)),
      jobs_(jobs),
      streams_(streams),
      max_per_stream_(max_per_stream),
      deadline_(deadline) {}

Load::~Load() { Stop(); }

void Load::Start() {
  for (int t = 0; t < streams_; ++t) threads_.emplace_back([this, t] { Run(t); });
}

void Load::Stop() {
  stop_ = true;
  for (auto& t : threads_) t.join();
  threads_.clear();
}

int Load::CompletedStartedAfter(Clock::time_point t) const {
  std::lock_guard lock(mu_);
  int n = 0;
  for (auto s : ok_starts_) n += s >= t;
  return n;
}

FaultStats Load::Stats(const std::string& fault) const {
  std::lock_guard lock(mu_);
  FaultStats s = stats_;
  s.fault = fault;
  return s;
}

void Load::Run(int stream) {
  auto stub = pb::Generation::NewStub(
      grpc::CreateChannel(proxy_, grpc::InsecureChannelCredentials()));
  for (int i = 0; i < max_per_stream_ && !stop_; ++i) {
    const Job& job = jobs_[static_cast<size_t>(stream * 7 + i) % jobs_.size()];
    grpc::ClientContext ctx;
    const auto start = Clock::now();
    ctx.set_deadline(std::chrono::system_clock::now() + deadline_);
    pb::GenerateRequest req;
    for (uint32_t t : job.prompt) req.add_prompt_token_ids(t);
    req.set_max_tokens(job.max_tokens);
    req.mutable_sampling()->set_temperature(job.temperature);
    if (job.temperature != 0) req.mutable_sampling()->set_seed(job.seed);
    req.set_ignore_eos(true);
    // Our own id, so that a request that hangs can be found in the fleet's
    // logs (the proxy logs it as [req=ID]).
    req.set_request_id(fmt::format("chaos-{}-{}", stream, i));
    auto reader = stub->Generate(&ctx, req);
    std::vector<uint32_t> got;
    pb::GenerateResponse resp;
    Clock::time_point first_at{}, last_at{};
    while (reader->Read(&resp)) {
      if (resp.token_ids().empty()) continue;
      last_at = Clock::now();
      if (first_at == Clock::time_point{}) first_at = last_at;
      got.insert(got.end(), resp.token_ids().begin(), resp.token_ids().end());
    }
    const grpc::Status st = reader->Finish();
    const auto took = Clock::now() - start;
    std::lock_guard lock(mu_);
    if (st.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED || took > deadline_ + std::chrono::seconds(2)) {
      // Still running at its deadline: whoever ended it, it hung.
      ++stats_.hung;
      stats_.statuses[fmt::format("hung: {} {}", static_cast<int>(st.error_code()),
                                  st.error_message().substr(0, 80))]++;
      // Where it stood: waiting for its first token, or streaming slowly.
      const auto at = [&](Clock::time_point t) {
        return t == Clock::time_point{} ? std::string("never")
                                        : fmt::format("{:.1f} s", std::chrono::duration<double>(t - start).count());
      };
      std::printf("[chaos] hung: request %s (%zu prompt tokens): %zu of %u tokens received, first at "
                  "%s, last at %s\n",
                  req.request_id().c_str(), job.prompt.size(), got.size(), job.max_tokens,
                  at(first_at).c_str(), at(last_at).c_str());
      std::fflush(stdout);
    } else if (st.ok()) {
      if (got == job.expected) {
        ++stats_.completed;
        ++completed_;
        ok_starts_.push_back(start);
      } else {
        ++stats_.mismatched;
        size_t at = 0;
        while (at < got.size() && at < job.expected.size() && got[at] == job.expected[at]) ++at;
        stats_.statuses[fmt::format("mismatch: job {} ({} prompt tokens, temperature {}), {} of {} "
                                    "tokens, first difference at token {}",
                                    &job - jobs_.data(), job.prompt.size(), job.temperature,
                                    got.size(), job.expected.size(), at)]++;
      }
    } else {
      ++stats_.failed;
      if (st.error_code() == grpc::StatusCode::UNKNOWN || st.error_message().empty()) ++stats_.unclear;
      stats_.statuses[fmt::format("{}: {}", static_cast<int>(st.error_code()),
                                  st.error_message().substr(0, 80))]++;
    }
  }
}

std::string Row(const FaultStats& s) {
  const int total = s.completed + s.mismatched + s.failed + s.hung;
  std::string statuses;
  for (const auto& [k, n] : s.statuses) statuses += fmt::format("{}× `{}`; ", n, k);
  return fmt::format("| {} | {} | {} | {} | {} | {} | {} | {} |", s.fault, total, s.completed,
                     s.failed, s.hung, s.mismatched,
                     s.recovery_ms < 0 ? std::string("—") : fmt::format("{:.0f} ms", s.recovery_ms),
                     s.note.empty() ? statuses : s.note + (statuses.empty() ? "" : "; " + statuses));
}

}  // namespace tandem::testing::chaos
