// A main for a libFuzzer target built without libFuzzer: runs every file
// of the folders named on the command line through LLVMFuzzerTestOneInput
// once, in name order, and prints how many. The target's own checks trap
// (a crash, a hang past its patience, a leaked slot or worker call), so a
// seed that fails ends the process. CI's build runs fuzz_h2_server's and
// fuzz_http_server's seeds this way (tests/CMakeLists.txt), so their code
// and seeds are checked at every commit although the fuzz build leaves
// them out.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

int main(int argc, char** argv) {
  std::vector<std::filesystem::path> files;
  for (int i = 1; i < argc; ++i) {
    for (const auto& e : std::filesystem::directory_iterator(argv[i])) {
      if (e.is_regular_file()) files.push_back(e.path());
    }
  }
  std::sort(files.begin(), files.end());
  if (files.empty()) {
    std::fprintf(stderr, "no seed files in the folders given\n");
    return 2;
  }
  for (const auto& f : files) {
    std::ifstream in(f, std::ios::binary);
    const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::fprintf(stderr, "%s (%zu bytes)\n", f.c_str(), bytes.size());
    LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  }
  std::fprintf(stderr, "%zu seeds passed\n", files.size());
  return 0;
}
