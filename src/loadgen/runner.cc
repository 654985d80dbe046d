#include "loadgen/runner.h"

#include <fmt/format.h>

#include <cmath>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <unordered_map>

namespace tandem::loadgen {
namespace {

struct SessionState {
  Session session;
  std::vector<uint32_t> conversation;  // every prompt and reply so far
  uint32_t next_turn = 0;
};

struct Finished {
  uint64_t session = 0;
  uint32_t turn = 0;
  uint32_t prompt_tokens = 0, requested_tokens = 0;
  Reply reply;
  std::string tenant;
  std::optional<int32_t> priority;
};

// The class of session `id` in a weighted mix (RunOptions::tenants).
template <class T>
const T* ClassOf(const std::vector<T>& classes, uint64_t id) {
  uint64_t total = 0;
  for (const T& c : classes) total += c.weight;
  if (total == 0) return nullptr;
  uint64_t at = id % total;
  for (const T& c : classes) {
    if (at < c.weight) return &c;
    at -= c.weight;
  }
  return nullptr;
}

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

RequestRecord ToRecord(const Finished& f, Clock::time_point start) {
  const Reply& r = f.reply;
  RequestRecord rec;
  rec.session = f.session;
  rec.turn = f.turn;
  rec.tenant = f.tenant;
  rec.priority = f.priority;
  rec.send_s = Seconds(r.sent - start);
  rec.e2e_s = Seconds(r.done - r.sent);
  rec.ok = r.status.ok();
  if (!rec.ok) {
    rec.error = std::string(StatusCodeName(r.status.code()));
    rec.message = r.status.message();
  }
  rec.prompt_tokens = f.prompt_tokens;
  rec.requested_tokens = f.requested_tokens;
  // HTTP replies carry text, not token ids: their count comes from usage.
  rec.output_tokens = r.token_ids.empty() && r.has_usage ? r.completion_tokens
                                                         : uint32_t(r.token_ids.size());
  rec.usage_prompt_tokens = r.prompt_tokens;
  rec.cached_prompt_tokens = r.cached_prompt_tokens;
  rec.finish_reason = r.finish_reason;
  for (size_t i = 0; i < r.chunks.size(); ++i) {
    const Chunk& c = r.chunks[i];
    rec.chunk_times_s.push_back(Seconds(c.at - start));
    rec.chunk_tokens.push_back(c.tokens);
    if (i == 0) {
      rec.ttft_s = Seconds(c.at - r.sent);
    } else {
      rec.itl_s.push_back(Seconds(c.at - r.chunks[i - 1].at));
    }
    // Tokens that travelled together: gaps of 0 after the first.
    for (uint32_t k = 1; k < c.tokens; ++k) rec.itl_s.push_back(0.0);
  }
  return rec;
}

}  // namespace

Result<RunResult> Run(Client& client, SessionSource& source, const RunOptions& o,
                      const std::function<void(const Progress&)>& progress) {
  const ArrivalOptions& a = o.arrival;
  if (a.kind == ArrivalKind::kConcurrency && a.concurrency == 0) {
    return InvalidArgumentError("--concurrency must be >= 1");
  }
  if (a.kind == ArrivalKind::kPoisson && !(a.rate > 0)) {
    return InvalidArgumentError(fmt::format("--request-rate must be > 0, got {}", a.rate));
  }
  if (a.kind == ArrivalKind::kPoisson && std::isinf(a.rate) && o.num_requests == 0) {
    return InvalidArgumentError("an infinite --request-rate needs --num-requests");
  }

  std::mutex mu;
  std::condition_variable cv;
  std::vector<Finished> finished;  // guarded by mu

  RunResult result;
  std::unordered_map<uint64_t, SessionState> sessions;
  std::deque<uint64_t> ready;  // sessions whose next turn can be sent now
  PoissonArrivals poisson(a.rate, a.seed);
  double next_arrival_s = 0.0;
  std::optional<Session> next_trace;
  bool source_done = false;
  if (a.kind == ArrivalKind::kTrace) {
    next_trace = source.Next();
    source_done = !next_trace;
  }
  bool stop_sending = false;
  uint64_t sent = 0, done = 0, failed = 0, inflight = 0, output_tokens = 0;
  const Clock::time_point start = Clock::now();
  Clock::time_point next_progress = start;

  const auto begin_session = [&](Session s) {
    const uint64_t id = s.id;
    if (s.turns.empty()) return;
    sessions.emplace(id, SessionState{std::move(s), {}, 0});
    ready.push_back(id);
  };
  const auto end_session = [&](uint64_t id) { sessions.erase(id); };

  while (true) {
    const double now_s = Seconds(Clock::now() - start);

    // 1. Replies.
    std::vector<Finished> batch;
    {
      std::lock_guard lk(mu);
      batch.swap(finished);
    }
    for (Finished& f : batch) {
      --inflight;
      ++done;
      RequestRecord rec = ToRecord(f, start);
      output_tokens += rec.output_tokens;
      if (!rec.ok) ++failed;
      auto it = sessions.find(f.session);
      if (it != sessions.end()) {
        SessionState& st = it->second;
        const bool more = st.next_turn < st.session.turns.size();
        if (!rec.ok) {
          if (more) ++result.aborted_sessions;
          end_session(f.session);
        } else if (!more) {
          end_session(f.session);
        } else {
          st.conversation.insert(st.conversation.end(), f.reply.token_ids.begin(),
                                 f.reply.token_ids.end());
          ready.push_back(f.session);
        }
      }
      result.records.push_back(std::move(rec));
    }

    // 2. Bounds.
    if (o.duration_s > 0 && now_s >= o.duration_s) stop_sending = true;
    if (o.num_requests > 0 && sent >= o.num_requests) stop_sending = true;

    // 3. New sessions.
    if (!stop_sending && !source_done) {
      switch (a.kind) {
        case ArrivalKind::kPoisson:
          while (!source_done && next_arrival_s <= now_s &&
                 (o.num_requests == 0 || sent + ready.size() < o.num_requests)) {
            auto s = source.Next();
            if (!s) {
              source_done = true;
              break;
            }
            begin_session(std::move(*s));
            next_arrival_s += poisson.NextGapSeconds();
          }
          break;
        case ArrivalKind::kTrace:
          while (next_trace && next_trace->start_s <= now_s) {
            begin_session(std::move(*next_trace));
            next_trace = source.Next();
          }
          source_done = !next_trace;
          break;
        case ArrivalKind::kConcurrency:
          while (sessions.size() < a.concurrency) {
            auto s = source.Next();
            if (!s) {
              source_done = true;
              break;
            }
            begin_session(std::move(*s));
          }
          break;
      }
    }

    // 4. Send what is ready.
    const uint32_t cap = a.kind == ArrivalKind::kConcurrency ? 0 : a.max_concurrency;
    while (!stop_sending && !ready.empty() && (cap == 0 || inflight < cap)) {
      const uint64_t id = ready.front();
      ready.pop_front();
      SessionState& st = sessions.at(id);
      const Turn& turn = st.session.turns[st.next_turn];
      st.conversation.insert(st.conversation.end(), turn.new_tokens.begin(),
                             turn.new_tokens.end());
      Request req;
      req.request_id = fmt::format("{}-{}", o.request_id_prefix, sent);
      req.model = o.model;
      req.prompt_token_ids = st.conversation;
      req.max_tokens = turn.max_tokens;
      req.temperature = o.temperature;
      if (o.seed) req.seed = *o.seed + sent;
      req.ignore_eos = o.ignore_eos;
      req.timeout = o.request_timeout;
      Finished meta{id, st.next_turn, uint32_t(req.prompt_token_ids.size()), turn.max_tokens, {},
                    {}, {}};
      if (const auto* t = ClassOf(o.tenants, id)) {
        req.api_key = t->api_key;
        meta.tenant = t->name;
      }
      if (const auto* p = ClassOf(o.priorities, id)) {
        req.priority = p->priority;
        meta.priority = p->priority;
      }
      ++st.next_turn;
      ++sent;
      ++inflight;
      client.Start(std::move(req), [&mu, &cv, &finished, meta](Reply r) mutable {
        meta.reply = std::move(r);
        std::lock_guard lk(mu);
        finished.push_back(std::move(meta));
        cv.notify_one();
      });
      if (o.num_requests > 0 && sent >= o.num_requests) stop_sending = true;
    }
    if (stop_sending && !ready.empty()) {
      for (uint64_t id : ready) {
        const SessionState& st = sessions.at(id);
        result.dropped_turns += st.session.turns.size() - st.next_turn;
      }
      ready.clear();
    }

    if (progress && Clock::now() >= next_progress) {
      progress(Progress{now_s, sent, done, failed, inflight, output_tokens, o.num_requests,
                        o.duration_s});
      next_progress = Clock::now() + std::chrono::milliseconds(500);
    }

    // 5. Done?
    if (inflight == 0 && ready.empty() &&
        (stop_sending || (source_done && sessions.empty()))) {
      break;
    }

    // 6. Wait for a reply, the next arrival, the duration bound or the
    //    next progress line.
    Clock::time_point wake = Clock::now() + std::chrono::milliseconds(500);
    const auto at = [&](double s) {
      return start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
    };
    if (!stop_sending) {
      if (a.kind == ArrivalKind::kPoisson && !source_done && std::isfinite(next_arrival_s)) {
        wake = std::min(wake, at(next_arrival_s));
      }
      if (a.kind == ArrivalKind::kTrace && next_trace) wake = std::min(wake, at(next_trace->start_s));
      if (o.duration_s > 0) wake = std::min(wake, at(o.duration_s));
    }
    if (progress) wake = std::min(wake, next_progress);
    std::unique_lock lk(mu);
    cv.wait_until(lk, wake, [&] { return !finished.empty(); });
  }
  if (progress) {
    progress(Progress{Seconds(Clock::now() - start), sent, done, failed, inflight, output_tokens,
                      o.num_requests, o.duration_s});
  }
  return result;
}

}  // namespace tandem::loadgen
