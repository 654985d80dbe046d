// fuzz_make_seeds KV_NOTICE_DIR [DESCRIPTOR_DIR]: writes the seed inputs of
// fuzz_kv_notice and fuzz_descriptor (binary formats with checksums, so
// they are made by the code that defines them): transport descriptors,
// framed notices and KvNotice payloads of the kinds a decoder receives.
// fuzz_make_seeds --wire CORPUS_DIR: the seeds of fuzz_grpc_request,
// fuzz_h2_client, fuzz_worker_frames, fuzz_tls_records, fuzz_api_key,
// fuzz_h2_server and fuzz_http_server (CORPUS_DIR/<target>/): Generate
// bodies and header values, a client's HTTP/2 bytes, decode stream and
// Watch batches, record scripts, API keys, whole client connections.
// The version-1 descriptor seeds (v1_*) are committed as session 13's code
// wrote them and not regenerated. The other targets' seeds are the
// repository's fixtures (tools/fuzz.sh seeds).
#include <google/protobuf/io/coded_stream.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "fuzz_worker_script.h"
#include "kvtransfer/descriptor.h"
#include "kvtransfer/staging/staging_notice.h"
#include "kvtransfer/transport_base.h"
#include "tandem/v1/wire/generation_wire.pb.h"
#include "tandem/v1/worker.pb.h"

namespace {

bool g_failed = false;

void Write(const std::string& dir, const std::string& name, const std::string& bytes) {
  std::ofstream out(dir + "/" + name, std::ios::binary);
  out << bytes;
  if (!out) {
    std::fprintf(stderr, "fuzz_make_seeds: cannot write %s/%s\n", dir.c_str(), name.c_str());
    g_failed = true;
  }
}

void PutVarint(std::string& out, uint64_t v) {
  uint8_t buf[10];  // a varint takes at most 10 bytes
  const uint8_t* end = google::protobuf::io::CodedOutputStream::WriteVarint64ToArray(v, buf);
  out.append(reinterpret_cast<const char*>(buf), static_cast<size_t>(end - buf));
}

// An HTTP/2 frame: 9-byte header, then the payload.
std::string Frame(uint8_t type, uint8_t flags, uint32_t stream_id, const std::string& payload) {
  std::string f;
  const uint32_t n = static_cast<uint32_t>(payload.size());
  for (int shift : {16, 8, 0}) f.push_back(static_cast<char>(n >> shift));
  f.push_back(static_cast<char>(type));
  f.push_back(static_cast<char>(flags));
  for (int shift : {24, 16, 8, 0}) f.push_back(static_cast<char>(stream_id >> shift));
  return f + payload;
}

std::string WindowUpdate(uint32_t stream_id, uint32_t increment) {
  std::string p;
  for (int shift : {24, 16, 8, 0}) p.push_back(static_cast<char>(increment >> shift));
  return Frame(0x8, 0, stream_id, p);
}

// `g` with its prompt's last id changed so that the scripted workers give it
// `script` (fuzz_worker_script.h; the first routing attempt).
tandem::v1::wire::GenerateRequestBytes ForScript(tandem::v1::wire::GenerateRequestBytes g,
                                                 int script) {
  std::vector<uint32_t> prompt(g.prompt_token_ids().begin(), g.prompt_token_ids().end());
  for (uint32_t last = 1; last < 4096; ++last) {
    prompt.back() = last;
    if (tandem::fuzz::ScriptOf(prompt, 1) == script) {
      g.set_prompt_token_ids(g.prompt_token_ids_size() - 1, last);
      return g;
    }
  }
  std::fprintf(stderr, "no last id gives script %d\n", script);
  std::abort();
}

void WriteWireSeeds(const std::string& root) {
  namespace pb = ::tandem::v1;
  // Generate bodies: ids (1-3 byte varints), text, ids unpacked, ids in two packed fields.
  pb::wire::GenerateRequestBytes ids;
  ids.set_request_id("req-1");
  for (uint32_t i = 0; i < 40; ++i) ids.add_prompt_token_ids(i * i * 97);
  ids.set_max_tokens(16);
  ids.mutable_sampling()->set_temperature(0.7f);
  ids.add_stop("\n\n");
  ids.add_stop_token_ids(2);
  ids.set_priority(-1);
  Write(root + "/grpc_request", "ids", ids.SerializeAsString());
  pb::wire::GenerateRequestBytes text;
  text.set_model("tandem-kjv");
  text.set_prompt("In the beginning");
  text.set_ignore_eos(true);
  text.set_ttft_slo_ms(500);
  Write(root + "/grpc_request", "text", text.SerializeAsString());
  std::string unpacked, two_packed, packed_a, packed_b;
  for (uint32_t id : {5u, 300u, 70000u}) {
    PutVarint(unpacked, (4 << 3) | 0);
    PutVarint(unpacked, id);
  }
  PutVarint(packed_a, 1);
  PutVarint(packed_a, 128);
  PutVarint(packed_b, 1u << 21);
  for (const std::string* p : {&packed_a, &packed_b}) {
    PutVarint(two_packed, (4 << 3) | 2);
    PutVarint(two_packed, p->size());
    two_packed += *p;
  }
  Write(root + "/grpc_request", "ids_unpacked", unpacked);
  Write(root + "/grpc_request", "ids_two_packed", two_packed);
  // The call's header values the same target reads.
  Write(root + "/grpc_request", "timeout_ms", "250m");
  Write(root + "/grpc_request", "timeout_longest", "99999999H");
  Write(root + "/grpc_request", "traceparent",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");

  // What a gRPC client sends: preface, SETTINGS, a window, a request's
  // HEADERS and DATA; a step's acknowledgements; a PING.
  const std::string preface = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
  const std::string settings = Frame(0x4, 0, 0, std::string("\x00\x04\x00\x40\x00\x00", 6));
  std::string grpc_message(1, '\0');  // not compressed, then the length (big-endian)
  const uint32_t length = static_cast<uint32_t>(ids.ByteSizeLong());
  for (int shift : {24, 16, 8, 0}) grpc_message.push_back(static_cast<char>(length >> shift));
  grpc_message += ids.SerializeAsString();
  const std::string request =
      Frame(0x1, 0x4, 1, "\x83\x86\x44\x8b") + Frame(0x0, 0x1, 1, grpc_message);
  std::string acks;
  for (uint32_t s = 1; s <= 31; s += 2) acks += WindowUpdate(s, 14);
  acks += WindowUpdate(0, 224);
  Write(root + "/h2_client", "request", preface + settings + WindowUpdate(0, 983041) + request);
  Write(root + "/h2_client", "acks",
        preface + settings + acks + Frame(0x6, 0, 0, "pingping") + acks);

  // A decode stream batch: tokens, a registration, a finish.
  pb::DecodeStreamResponse batch;
  for (uint64_t h = 1; h <= 4; ++h) {
    auto* it = batch.add_items();
    it->set_handle(h * 1000);
    it->set_first_index(static_cast<uint32_t>(h * 7));
    it->add_token_ids(static_cast<uint32_t>(h * 4099));
    if (h == 2) it->set_registered(true);
    if (h == 4) {
      it->mutable_finished()->set_finish_reason(pb::FINISH_REASON_LENGTH);
      it->mutable_finished()->set_completion_tokens(64);
      it->mutable_finished()->set_decoder_cached_prompt_tokens(16);
    }
  }
  Write(root + "/worker_frames", "decode_batch", batch.SerializeAsString());
  // A Watch batch: stored, removed and cleared events, the round's load.
  pb::WorkerUpdate u;
  u.set_epoch(77);
  auto* stored = u.add_events();
  stored->set_event_id(10);
  stored->set_epoch(77);
  stored->mutable_stored()->set_parent_hash(0xabcdef);
  for (uint64_t h = 1; h <= 8; ++h) {
    stored->mutable_stored()->add_block_hashes_fixed64(h * 0x9e3779b97f4a7c15ull);
  }
  auto* removed = u.add_events();
  removed->set_event_id(11);
  removed->set_epoch(77);
  removed->mutable_removed()->set_tier(pb::KV_TIER_HOST);
  removed->mutable_removed()->add_block_hashes_fixed64(3);
  auto* cleared = u.add_events();
  cleared->set_event_id(12);
  cleared->set_epoch(77);
  cleared->mutable_cleared();
  u.mutable_batched_load()->set_queued_prefill_tokens(8000);
  u.mutable_batched_load()->set_free_blocks(1234);
  Write(root + "/worker_frames", "watch_batch", u.SerializeAsString());

  // fuzz_h2_server: whole connections after the preface and SETTINGS the
  // target sends (first byte 1; 3: the rest one byte per write; 5: the
  // calls end before the client's end closes). Headers
  // as HPACK literals without indexing (RFC 7541 6.2.2), no Huffman.
  const std::string h2 = root + "/h2_server";
  auto literal = [](const std::string& name, const std::string& value) {
    return std::string(1, '\0') + static_cast<char>(name.size()) + name +
           static_cast<char>(value.size()) + value;
  };
  auto call = [&](uint32_t stream, const std::string& path, const std::string& extra) {
    return Frame(0x1, 0x4, stream,
                 "\x83" + literal(":scheme", "http") + literal(":path", path) +
                     literal(":authority", "fuzz") + literal("content-type", "application/grpc") +
                     literal("te", "trailers") + extra);
  };
  auto message = [](const std::string& body, char compressed = 0) {
    std::string m(1, compressed);
    const uint32_t n = static_cast<uint32_t>(body.size());
    for (int shift : {24, 16, 8, 0}) m.push_back(static_cast<char>(n >> shift));
    return m + body;
  };
  auto end = [](uint32_t stream, const std::string& m) { return Frame(0x0, 0x1, stream, m); };
  const std::string generate = "/tandem.v1.Generation/Generate";
  // Ids the bundled model's vocabulary (4096) holds: the call reaches routing.
  pb::wire::GenerateRequestBytes fits = ids;
  fits.clear_prompt_token_ids();
  for (uint32_t i = 0; i < 40; ++i) fits.add_prompt_token_ids(i * 97 % 4096);
  Write(h2, "generate_ids",
        "\x01" + call(1, generate, "") + end(1, message(fits.SerializeAsString())));
  Write(h2, "generate_ids_answered",
        "\x05" + call(1, generate, "") + end(1, message(fits.SerializeAsString())));
  Write(h2, "generate_ids_bytewise",
        "\x03" + call(1, generate, "") + end(1, message(fits.SerializeAsString())));
  Write(h2, "generate_text",
        "\x05" + call(1, generate, literal("grpc-timeout", "5S")) +
            end(1, message(text.SerializeAsString())));
  Write(h2, "three_calls",
        "\x05" + call(1, generate, "") + call(3, generate, "") +
            end(3, message(fits.SerializeAsString())) + end(1, message(text.SerializeAsString())) +
            call(5, "/tandem.v1.Generation/ListModels", "") + end(5, message("")));
  Write(h2, "health_check",
        "\x01" + call(1, "/grpc.health.v1.Health/Check", "") + end(1, message("")));
  Write(h2, "health_watch",
        "\x01" + call(1, "/grpc.health.v1.Health/Watch", "") + end(1, message("")));
  Write(h2, "reflection_list",
        "\x01" + call(1, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", "") +
            end(1, message(std::string("\x3a\x00", 2))));
  Write(h2, "unknown_method",
        "\x01" + call(1, "/tandem.v1.Generation/Nope", "") + end(1, message("")));
  Write(h2, "compressed",
        "\x01" + call(1, generate, "") + end(1, message(fits.SerializeAsString(), 1)));
  Write(h2, "bad_timeout",
        "\x01" + call(1, generate, literal("grpc-timeout", "12x")) +
            end(1, message(fits.SerializeAsString())));
  Write(h2, "authorization",
        "\x01" + call(1, generate, literal("authorization", "Bearer nope")) +
            end(1, message(fits.SerializeAsString())));
  const std::string half = message(fits.SerializeAsString()).substr(0, 20);
  Write(h2, "reset_mid_call",
        "\x01" + call(1, generate, "") + Frame(0x0, 0, 1, half) +
            Frame(0x3, 0, 1, std::string("\x00\x00\x00\x08", 4)));
  // One call for each of the scripted workers' scripts (fuzz_worker_script.h),
  // the prompt's last id chosen for it; a stalled decode cancelled by the
  // client (RST_STREAM CANCEL); a completion into a window of 0 (SETTINGS
  // INITIAL_WINDOW_SIZE 0: the proxy may send no DATA).
  for (int script = 0; script < tandem::fuzz::kWorkerScripts; ++script) {
    const pb::wire::GenerateRequestBytes g = ForScript(fits, script);
    Write(h2, "script_" + std::to_string(script),
          "\x05" + call(1, generate, "") + end(1, message(g.SerializeAsString())));
  }
  Write(h2, "cancel_stalled",
        "\x05" + call(1, generate, "") +
            end(1, message(ForScript(fits, tandem::fuzz::kDecodeStalls).SerializeAsString())) +
            Frame(0x3, 0, 1, std::string("\x00\x00\x00\x08", 4)));
  // The same over TLS (bit 3: the TLS server, ALPN h2), whole and one
  // record per byte.
  auto script_call = [&](int script) {
    return call(1, generate, "") + end(1, message(ForScript(fits, script).SerializeAsString()));
  };
  Write(h2, "tls_script_0", "\x0d" + script_call(0));
  Write(h2, "tls_script_7_bytewise", "\x0f" + script_call(tandem::fuzz::kDecodeBreaks));
  Write(h2, "tls_cancel_stalled",
        "\x0d" + script_call(tandem::fuzz::kDecodeStalls) +
            Frame(0x3, 0, 1, std::string("\x00\x00\x00\x08", 4)));
  Write(h2, "zero_window",
        "\x05" + Frame(0x4, 0, 0, std::string("\x00\x04\x00\x00\x00\x00", 6)) +
            call(1, generate, "") + end(1, message(ForScript(fits, 0).SerializeAsString())));
  Write(h2, "ping_window_goaway",
        "\x01" + Frame(0x4, 0x1, 0, "") + Frame(0x6, 0, 0, "pingping") + WindowUpdate(0, 1 << 20) +
            call(1, generate, "") + WindowUpdate(1, 4096) +
            end(1, message(fits.SerializeAsString())) + Frame(0x7, 0, 0, std::string(8, '\0')));

  // fuzz_http_server: whole connections (first byte 0; 2: one byte per
  // write; 4: the requests end before the client's end closes; 16: the
  // first request's Content-Length fitted to its body).
  const std::string http = root + "/http_server";
  auto post = [](const std::string& path, const std::string& body, const std::string& extra = "") {
    return "POST " + path + " HTTP/1.1\r\nHost: fuzz\r\nContent-Type: application/json\r\n" +
           extra + "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
  };
  const std::string completion =
      R"({"model":"tandem-kjv","prompt":"In the beginning","max_tokens":4})";
  const std::string chat =
      R"({"model":"tandem-kjv","messages":[{"role":"user","content":"hi"}],"stream":true,)"
      R"("stream_options":{"include_usage":true},"max_tokens":4})";
  Write(http, "completion", "\x04" + post("/v1/completions", completion));
  Write(http, "completion_bytewise", "\x06" + post("/v1/completions", completion));
  Write(http, "chat_stream", "\x04" + post("/v1/chat/completions", chat));
  Write(http, "token_ids",
        "\x04" + post("/v1/completions",
                      R"({"model":"tandem-kjv","prompt":[1,2,3],"max_tokens":2,"stop":["\n"]})"));
  Write(http, "models", std::string(1, '\0') + "GET /v1/models HTTP/1.1\r\nHost: fuzz\r\n\r\n");
  Write(http, "head", std::string(1, '\0') + "HEAD /v1/models HTTP/1.1\r\nHost: fuzz\r\n\r\n");
  Write(http, "pipelined",
        "\x04GET /health HTTP/1.1\r\nHost: fuzz\r\n\r\n" + post("/v1/completions", completion) +
            "GET /metrics HTTP/1.1\r\nHost: fuzz\r\n\r\n");
  // Two chunks: 0x10 and 0x31 bytes.
  Write(http, "chunked",
        "\x04POST /v1/completions HTTP/1.1\r\nHost: fuzz\r\nTransfer-Encoding: chunked\r\n\r\n"
        "10\r\n{\"model\":\"tandem\r\n"
        "31\r\n-kjv\",\"prompt\":\"In the beginning\",\"max_tokens\":4}\r\n"
        "0\r\n\r\n");
  Write(http, "bad_json", "\x04" + post("/v1/completions", R"({"model":"tandem-kjv","prompt":)"));
  Write(http, "authorization",
        "\x04" + post("/v1/completions", completion, "Authorization: Bearer nope\r\n"));
  // One completion for each script of the scripted workers, with token ids;
  // the odd ones streamed.
  for (int script = 0; script < tandem::fuzz::kWorkerScripts; ++script) {
    const pb::wire::GenerateRequestBytes g = ForScript(fits, script);
    std::string body = R"({"model":"tandem-kjv","max_tokens":16,"prompt":[)";
    for (int i = 0; i < g.prompt_token_ids_size(); ++i) {
      body += (i ? "," : "") + std::to_string(g.prompt_token_ids(i));
    }
    body += script % 2 ? R"(],"stream":true})" : "]}";
    Write(http, "script_" + std::to_string(script), "\x04" + post("/v1/completions", body));
  }
  // Bit 4: a Content-Length that does not fit (1) and none at all, both
  // fitted by the target.
  Write(http, "fit_length",
        "\x14POST /v1/completions HTTP/1.1\r\nHost: fuzz\r\nContent-Length: 1\r\n\r\n" +
            completion);
  Write(http, "fit_no_length",
        "\x14POST /v1/chat/completions HTTP/1.1\r\nHost: fuzz\r\n\r\n" + chat);
  Write(http, "expect_continue",
        "\x04" + post("/v1/completions", completion, "Expect: 100-continue\r\n"));
  // Over TLS (bit 3): a completion, a streamed chat, a pipelined pair one
  // record per byte.
  Write(http, "tls_completion", "\x0c" + post("/v1/completions", completion));
  Write(http, "tls_chat_stream", "\x0c" + post("/v1/chat/completions", chat));
  Write(http, "tls_pipelined_bytewise",
        "\x0eGET /health HTTP/1.1\r\nHost: fuzz\r\n\r\n" + post("/v1/completions", completion));
}

// fuzz_tls_records' scripts (the ops are listed above its
// LLVMFuzzerTestOneInput): one byte for the first sequence number, then ops.
void WriteTlsRecordScripts(const std::string& dir) {
  const std::string app = std::string("\x00\x05", 2) + "hello";
  auto script = [](uint8_t first, const std::string& ops) {
    return std::string(1, static_cast<char>(first)) + ops;
  };
  const std::string full = std::string("\x01\x40\x00", 3);  // 2^14 bytes
  const std::string padded = std::string("\x03\x03\x00\x20\x17", 5) + "abc";
  const std::string seal_two = std::string("\x08\x15\x56", 3);  // 16386 bytes: 2 records
  Write(dir, "records", script(0, app + full + padded + std::string("\x08\x00\x10", 3) + seal_two));
  Write(dir, "close_notify", script(0, app + std::string("\x02\x15\x02\x01\x00", 5)));
  Write(dir, "alert", script(0, app + std::string("\x02\x15\x02\x02\x28", 5)));
  Write(dir, "key_update", script(0, app + std::string("\x02\x16\x05\x18\x00\x00\x01\x00", 8)));
  Write(dir, "flipped_byte", script(0, app + std::string("\x04\x00\x07\x01", 4) + app));
  Write(dir, "skipped_sequence", script(0, app + std::string("\x06", 1) + app));
  Write(dir, "unprotected", script(0, app + std::string("\x05\x05\x16\x03\x03\x00\x01", 7)));
  Write(dir, "too_long", script(0, app + std::string("\x05\x05\x17\x03\x03\x41\x01", 7)));
  Write(dir, "inner_over_limit", script(0, app + std::string("\x01\x40\x01", 3)));
  Write(dir, "only_padding", script(0, app + std::string("\x03\x00\x00\x10\x00", 5)));
  Write(dir, "legacy_version", script(0, std::string("\x07\x03\x01", 3) + app + app));
  Write(dir, "short", script(0, std::string("\x05\x0a\x17\x03\x03\x00\x05", 7) + "12345"));
  Write(dir, "sequence_wraps", script(1, app + app + std::string("\x08\x00\x01", 3)));
}

// fuzz_api_key's inputs: two keys (a length byte, then the bytes), then the
// header value.
void WriteApiKeySeeds(const std::string& dir) {
  const std::string keys = std::string("\x03", 1) + "abc" + std::string("\x04", 1) + "wxyz";
  Write(dir, "first_key", keys + "Bearer abc");
  Write(dir, "second_key_any_case", keys + "bEaReR    wxyz");
  Write(dir, "wrong_key", keys + "Bearer abd");
  Write(dir, "no_scheme", keys + "wxyz");
  Write(dir, "missing", keys);
  Write(dir, "file_key_only", std::string("\x00\x04", 2) + "wxyzBearer wxyz");
  Write(dir, "same_key_twice", std::string("\x03", 1) + "abc" + std::string("\x03", 1) + "abc");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 3 && std::string(argv[1]) == "--wire") {
    WriteWireSeeds(argv[2]);
    WriteTlsRecordScripts(std::string(argv[2]) + "/tls_records");
    WriteApiKeySeeds(std::string(argv[2]) + "/api_key");
    return g_failed ? 1 : 0;
  }
  if (argc != 2 && argc != 3) {
    std::fprintf(stderr,
                 "usage: fuzz_make_seeds KV_NOTICE_DIR [DESCRIPTOR_DIR] | --wire CORPUS_DIR\n");
    return 2;
  }
  const std::string dir = argv[1];
  const std::string desc_dir = argc == 3 ? argv[2] : argv[1];
  namespace kv = tandem::kvtransfer;
  kv::PeerDescriptor d;
  d.backend = "ucx";
  d.agent_name = "decode-0";
  d.generation = 1764590000123456789ull;
  d.block_bytes = 65536;
  d.num_blocks = 512;
  d.remote_base = 0x7f0000000000ull;
  d.address = std::string(64, '\x11');
  d.rkey = std::string(32, '\x22');
  d.process = {4711, 123456789, 4026531836, "d511850e-c1f7-44f5-ba3b-85b6c6eee4bf"};
  Write(desc_dir, "descriptor_ucx", kv::SerializeDescriptor(d));
  kv::PeerDescriptor unknown = d;  // an exporter that could not read /proc
  unknown.process = {};
  Write(desc_dir, "descriptor_unknown_process", kv::SerializeDescriptor(unknown));
  d.backend = "loopback";
  d.address.clear();
  d.rkey.clear();
  Write(desc_dir, "descriptor_loopback", kv::SerializeDescriptor(d));

  tandem::v1::KvNotice ok;
  ok.set_request_id("req-1");
  ok.set_reservation_id(0x9e3779b97f4a7c15ull);
  ok.set_generation(d.generation);
  ok.set_first_token_id(42);
  ok.set_prefill_cached_prompt_tokens(32);
  ok.set_capability(std::string(16, '\x5a'));
  tandem::v1::KvNotice gave_up = ok;
  gave_up.mutable_error()->set_code(14);
  gave_up.mutable_error()->set_message("prefiller gave up");
  Write(dir, "notice_ok", ok.SerializeAsString());
  Write(dir, "notice_error", gave_up.SerializeAsString());
  Write(dir, "framed_ok", kv::detail::EncodeNotice(d.generation, 7, "prefill-0", ok.SerializeAsString()));
  Write(dir, "framed_error",
        kv::detail::EncodeNotice(d.generation, 7, "prefill-0", gave_up.SerializeAsString()));
  Write(dir, "hex", kv::ToHex(kv::SerializeDescriptor(d)));
  // transport.encrypt's tags and transport.checksum's sums, 3 pushed blocks.
  tandem::v1::KvNotice sealed = ok;
  sealed.set_kv_tags(std::string(3 * 16, '\x3c'));
  for (uint64_t i = 0; i < 3; ++i) sealed.add_block_checksums(0x0123456789abcdefull * (i + 1));
  Write(dir, "notice_sealed", sealed.SerializeAsString());
  // The staging path's notices (cuda workers): a manifest and a user notice.
  namespace stg = kv::staging;
  stg::StagingNotice m;
  m.kind = stg::StagingNotice::Kind::kManifest;
  m.count = 3;
  m.ranges = {{0, 65536}, {131072, 196608}};
  Write(dir, "staging_manifest", stg::EncodeStagingNotice(m));
  stg::StagingNotice u;
  u.kind = stg::StagingNotice::Kind::kUser;
  u.count = 4;
  u.payload = sealed.SerializeAsString();
  Write(dir, "staging_user", stg::EncodeStagingNotice(u));
  return g_failed ? 1 : 0;
}
