#include "safetensors.hpp"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <stdexcept>

#include <nlohmann/json.hpp>

namespace fedmoe {

namespace {
constexpr uint64_t kMaxHeader = 16ull << 20;  // §6.5: N <= 16 MiB
constexpr int64_t kMaxDim = (1ll << 40) - 1;
}  // namespace

size_t dtype_size(const std::string& d) {
  static const std::map<std::string, size_t> sizes = {{"F64", 8}, {"F32", 4}, {"F16", 2}, {"BF16", 2},
                                                      {"I64", 8}, {"I32", 4}, {"I8", 1},  {"U8", 1}};
  auto it = sizes.find(d);
  if (it == sizes.end()) throw std::runtime_error("unknown safetensors dtype " + d);
  return it->second;
}

uint64_t numel(const std::vector<int64_t>& shape) {
  uint64_t n = 1;
  for (auto d : shape) {
    if (d < 0 || __builtin_mul_overflow(n, static_cast<uint64_t>(d), &n) || n > (1ull << 62))
      throw std::runtime_error("tensor shape has more than 2^62 elements");
  }
  return n;
}

std::vector<uint8_t> read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  if (!f) throw std::runtime_error(path + ": cannot open");
  const auto size = static_cast<size_t>(f.tellg());
  std::vector<uint8_t> bytes(size);
  f.seekg(0);
  f.read(reinterpret_cast<char*>(bytes.data()), static_cast<std::streamsize>(size));
  if (!f) throw std::runtime_error(path + ": read failed");
  return bytes;
}

SafetensorsFile::SafetensorsFile(const std::string& path) : bytes_(read_file(path)) { parse(path); }

SafetensorsFile::SafetensorsFile(std::vector<uint8_t> bytes, const std::string& what) : bytes_(std::move(bytes)) {
  parse(what);
}

void SafetensorsFile::parse(const std::string& what) {
  const size_t size = bytes_.size();
  if (size < 8) throw std::runtime_error(what + ": shorter than the 8-byte header length");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | bytes_[i];
  if (n > kMaxHeader || n > size - 8) throw std::runtime_error(what + ": header length beyond the file (or the 16 MiB limit)");
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(bytes_.begin() + 8, bytes_.begin() + 8 + static_cast<long>(n));
  } catch (const nlohmann::json::exception&) {
    throw std::runtime_error(what + ": header is not JSON");
  }
  if (!header.is_object()) throw std::runtime_error(what + ": header is not a JSON object");
  const size_t base = 8 + n, data_size = size - base;
  std::vector<std::pair<uint64_t, uint64_t>> spans;
  for (const auto& [name, v] : header.items()) {
    if (name == "__metadata__") {
      if (!v.is_object()) throw std::runtime_error(what + ": __metadata__ is not an object");
      for (const auto& [k, s] : v.items()) {
        if (!s.is_string()) throw std::runtime_error(what + ": metadata " + k + " is not a string");
        metadata_[k] = s.get<std::string>();
      }
      continue;
    }
    if (!v.is_object() || v.size() != 3 || !v.contains("dtype") || !v.contains("shape") || !v.contains("data_offsets"))
      throw std::runtime_error(what + ": tensor " + name + " entry is not exactly {dtype, shape, data_offsets}");
    const auto& dt = v["dtype"];
    const auto& sh = v["shape"];
    const auto& off = v["data_offsets"];
    if (!dt.is_string() || !sh.is_array() || !off.is_array() || off.size() != 2)
      throw std::runtime_error(what + ": tensor " + name + " entry has wrong types");
    TensorView t;
    t.dtype = dt.get<std::string>();
    const size_t esize = dtype_size(t.dtype);
    for (const auto& d : sh) {
      if (!d.is_number_integer() || d.get<int64_t>() < 0 || d.get<int64_t>() > kMaxDim)
        throw std::runtime_error(what + ": tensor " + name + " has a dimension outside 0..2^40-1");
      t.shape.push_back(d.get<int64_t>());
    }
    for (const auto& o : off)
      if (!o.is_number_unsigned()) throw std::runtime_error(what + ": tensor " + name + " has a bad data offset");
    const uint64_t a = off[0].get<uint64_t>(), b = off[1].get<uint64_t>();
    if (a > b || b > data_size) throw std::runtime_error(what + ": tensor " + name + " has offsets outside the data");
    const uint64_t count = numel(t.shape);
    if (count > (1ull << 62) / esize || count * esize != b - a)
      throw std::runtime_error(what + ": tensor " + name + " size disagrees with its shape");
    t.data = bytes_.data() + base + a;
    t.nbytes = b - a;
    spans.emplace_back(a, b);
    tensors_.emplace(name, t);
  }
  std::sort(spans.begin(), spans.end());
  uint64_t at = 0;
  for (const auto& [a, b] : spans) {
    if (a != at) throw std::runtime_error(what + ": tensor data overlap or leave gaps");
    at = b;
  }
  if (at != data_size) throw std::runtime_error(what + ": bytes after the last tensor");
}

const TensorView& SafetensorsFile::at(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) throw std::runtime_error("no tensor " + name);
  return it->second;
}

namespace {

// the 8-byte little-endian header length and the JSON header, padded with spaces so that the data starts 8-aligned
std::string safetensors_header(const std::map<std::string, TensorView>& tensors,
                               const std::map<std::string, std::string>& metadata) {
  nlohmann::json header = nlohmann::json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    header[name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {offset, offset + t.nbytes}}};
    offset += t.nbytes;
  }
  std::string h = header.dump();
  h.append((8 - h.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  const uint64_t n = h.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + h;
}

}  // namespace

std::vector<uint8_t> safetensors_bytes(const std::map<std::string, TensorView>& tensors,
                                       const std::map<std::string, std::string>& metadata) {
  const std::string h = safetensors_header(tensors, metadata);
  size_t size = h.size();
  for (const auto& [name, t] : tensors) size += t.nbytes;
  std::vector<uint8_t> out(size);
  std::memcpy(out.data(), h.data(), h.size());
  size_t at = h.size();
  for (const auto& [name, t] : tensors) {
    if (t.nbytes) std::memcpy(out.data() + at, t.data, t.nbytes);
    at += t.nbytes;
  }
  return out;
}

void write_safetensors(const std::string& path, const std::map<std::string, TensorView>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  // written tensor by tensor from where they are: no second copy of the state in memory
  const std::string h = safetensors_header(tensors, metadata);
  std::ofstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error(path + ": cannot write");
  f.write(h.data(), static_cast<std::streamsize>(h.size()));
  for (const auto& [name, t] : tensors)
    f.write(reinterpret_cast<const char*>(t.data), static_cast<std::streamsize>(t.nbytes));
  if (!f) throw std::runtime_error(path + ": write failed");
}

}  // namespace fedmoe
