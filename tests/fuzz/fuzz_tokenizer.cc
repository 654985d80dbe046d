// libFuzzer target: tokenizer.json as Tokenizer::Load reads it; a loaded
// tokenizer then encodes and decodes a fixed text and its own vocabulary's
// edges.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "fuzz_util.h"
#include "model/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  tandem::fuzz::QuietLogs();
  tandem::fuzz::MemFile file(data, size, "tokenizer.json");
  auto tok = tandem::model::Tokenizer::Load(file.path());
  if (!tok.ok()) return 0;
  const auto ids = (*tok)->Encode("Hello, world! <|endoftext|> caf\xc3\xa9 \xe2\x82\xac 123", true);
  (void)(*tok)->Decode(ids);
  const uint32_t n = (*tok)->vocab_size();
  std::vector<uint32_t> edges = {0, n > 0 ? n - 1 : 0, n, n + 1};
  (void)(*tok)->Decode(edges, true);
  tandem::model::IncrementalDetokenizer detok(tok->get());
  for (uint32_t id : ids) (void)detok.Push(id);
  (void)detok.Flush();
  return 0;
}
