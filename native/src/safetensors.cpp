#include "safetensors.hpp"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <stdexcept>

#include <nlohmann/json.hpp>

namespace fedmoe {

size_t dtype_size(const std::string& d) {
  static const std::map<std::string, size_t> sizes = {
      {"F64", 8}, {"F32", 4}, {"F16", 2}, {"BF16", 2}, {"I64", 8}, {"I32", 4},
      {"I16", 2}, {"I8", 1},  {"U8", 1},  {"BOOL", 1}};
  auto it = sizes.find(d);
  if (it == sizes.end()) throw std::runtime_error("unknown safetensors dtype " + d);
  return it->second;
}

SafetensorsFile::SafetensorsFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  if (!f) throw std::runtime_error(path + ": cannot open");
  const auto size = static_cast<size_t>(f.tellg());
  if (size < 8) throw std::runtime_error(path + ": shorter than the 8-byte header length");
  bytes_.resize(size);
  f.seekg(0);
  f.read(reinterpret_cast<char*>(bytes_.data()), static_cast<std::streamsize>(size));
  if (!f) throw std::runtime_error(path + ": read failed");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | bytes_[i];
  if (n > size - 8) throw std::runtime_error(path + ": header length beyond the file");
  const auto header = nlohmann::json::parse(bytes_.begin() + 8, bytes_.begin() + 8 + static_cast<long>(n));
  const size_t base = 8 + n, data_size = size - base;
  std::vector<std::pair<uint64_t, uint64_t>> spans;
  for (const auto& [name, v] : header.items()) {
    if (name == "__metadata__") continue;
    TensorView t;
    t.dtype = v.at("dtype").get<std::string>();
    t.shape = v.at("shape").get<std::vector<int64_t>>();
    const auto off = v.at("data_offsets").get<std::vector<uint64_t>>();
    if (off.size() != 2 || off[0] > off[1] || off[1] > data_size)
      throw std::runtime_error(path + ": tensor " + name + " has offsets outside the data");
    uint64_t count = 1;
    for (auto d : t.shape) {
      if (d < 0) throw std::runtime_error(path + ": tensor " + name + " has a negative dimension");
      count *= static_cast<uint64_t>(d);
    }
    if (count * dtype_size(t.dtype) != off[1] - off[0])
      throw std::runtime_error(path + ": tensor " + name + " size disagrees with its shape");
    t.data = bytes_.data() + base + off[0];
    t.nbytes = off[1] - off[0];
    spans.emplace_back(off[0], off[1]);
    tensors_.emplace(name, t);
  }
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i)
    if (spans[i].first < spans[i - 1].second) throw std::runtime_error(path + ": tensors overlap");
}

const TensorView& SafetensorsFile::at(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) throw std::runtime_error("no tensor " + name);
  return it->second;
}

void write_safetensors(const std::string& path, const std::map<std::string, TensorView>& tensors) {
  nlohmann::json header = nlohmann::json::object();
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    header[name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {offset, offset + t.nbytes}}};
    offset += t.nbytes;
  }
  std::string h = header.dump();
  h.append((8 - h.size() % 8) % 8, ' ');  // the data starts 8-aligned
  std::ofstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error(path + ": cannot write");
  uint64_t n = h.size();
  for (int i = 0; i < 8; ++i) f.put(static_cast<char>((n >> (8 * i)) & 0xff));
  f.write(h.data(), static_cast<std::streamsize>(h.size()));
  for (const auto& [name, t] : tensors) f.write(reinterpret_cast<const char*>(t.data), static_cast<std::streamsize>(t.nbytes));
  if (!f) throw std::runtime_error(path + ": write failed");
}

}  // namespace fedmoe
