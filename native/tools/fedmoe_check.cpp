// fedmoe-native-check: the native device's protocol pieces on files, for tests against the
// Python reference (tests/test_native_device.py); not part of a device.
//
//   decode IN OUT               a tensor payload (any format, compressed or not) -> fp32 safetensors
//   encode IN OUT [compress]    fp32 safetensors -> an fp32 payload (FMZ1zlib with compress)
//   split IN MAX ID KIND ROUND DIR   chunk messages DIR/0000.chunk ...
//   join DIR OUT                the chunk messages of DIR reassembled
//   shuffle SEED N              random.Random(SEED).shuffle(range(N)) as JSON
//   sign SEED_B64 TEXT          the base64 Ed25519 signature of TEXT
// Exit status 2 with the reason on stderr when the input is refused.
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "chunks.hpp"
#include "crypto.hpp"
#include "payload.hpp"
#include "pyrandom.hpp"
#include "safetensors.hpp"

int main(int argc, char** argv) {
  const std::vector<std::string> a(argv + 1, argv + argc);
  try {
    if (a.size() >= 3 && a[0] == "decode") {
      auto d = fedmoe::decode_payload(fedmoe::read_file(a[1]), 1ull << 31);
      std::map<std::string, fedmoe::TensorView> views;
      for (auto& [k, t] : d.tensors)
        views[k] = fedmoe::TensorView{"F32", t.shape, reinterpret_cast<uint8_t*>(t.data.data()), t.data.size() * 4};
      fedmoe::write_safetensors(a[2], views, {{"fedmoe.encoding", d.encoding}});
    } else if (a.size() >= 3 && a[0] == "encode") {
      const auto d = fedmoe::decode_payload(fedmoe::read_file(a[1]), 1ull << 31);
      const auto out = fedmoe::encode_fp32(d.tensors, a.size() > 3 && a[3] == "compress");
      std::ofstream(a[2], std::ios::binary).write(reinterpret_cast<const char*>(out.data()), static_cast<long>(out.size()));
    } else if (a.size() >= 7 && a[0] == "split") {
      std::string sha;
      const auto chunks = fedmoe::split_blob(fedmoe::read_file(a[1]), std::stoull(a[2]), a[3], a[4], std::stoull(a[5]), &sha);
      std::filesystem::create_directories(a[6]);
      for (size_t i = 0; i < chunks.size(); ++i) {
        char name[32];
        std::snprintf(name, sizeof name, "/%06zu.chunk", i);
        std::ofstream(a[6] + name, std::ios::binary).write(reinterpret_cast<const char*>(chunks[i].data()), static_cast<long>(chunks[i].size()));
      }
      std::cout << sha << "\n";
    } else if (a.size() >= 3 && a[0] == "join") {
      std::vector<std::string> files;
      for (const auto& e : std::filesystem::directory_iterator(a[1])) files.push_back(e.path());
      std::sort(files.begin(), files.end());
      fedmoe::Reassembler r(1ull << 31);
      for (const auto& f : files)
        if (auto blob = r.add(fedmoe::read_file(f))) {
          std::ofstream(a[2], std::ios::binary).write(reinterpret_cast<const char*>(blob->data.data()), static_cast<long>(blob->data.size()));
          return 0;
        }
      throw std::runtime_error("the chunks did not complete a blob");
    } else if (a.size() >= 3 && a[0] == "shuffle") {
      std::vector<long> x(std::stoul(a[2]));
      for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<long>(i);
      fedmoe::PyRandom(std::stoull(a[1])).shuffle(x);
      std::cout << nlohmann::json(x).dump() << "\n";
    } else if (a.size() >= 3 && a[0] == "sign") {
      std::cout << fedmoe::Signer(a[1]).sign_b64(a[2]) << "\n";
    } else {
      std::cerr << "usage: see native/tools/fedmoe_check.cpp\n";
      return 2;
    }
  } catch (const std::exception& e) {
    std::cerr << "fedmoe-native-check: " << e.what() << "\n";
    return 2;
  }
  return 0;
}
