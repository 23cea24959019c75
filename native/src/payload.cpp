#include "payload.hpp"

#include <zlib.h>

#include <cmath>
#include <cstring>
#include <set>
#include <stdexcept>

#include "safetensors.hpp"

namespace fedmoe {

const float kNF4[16] = {-1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f,
                        -0.28444138169288635f, -0.18477343022823334f, -0.09105003625154495f, 0.0f,
                        0.07958029955625534f, 0.16093020141124725f, 0.24611230194568634f, 0.33791524171829224f,
                        0.44070982933044434f, 0.5626170039176941f, 0.7229568362236023f, 1.0f};

namespace {

const char kZMagic[8] = {'F', 'M', 'Z', '1', 'z', 'l', 'i', 'b'};

float half_to_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      uint32_t m = man;
      do {
        ++e;
        m <<= 1;
      } while ((m & 0x400u) == 0);
      bits = sign | ((127 - 15 - e) << 23) | ((m & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

std::vector<float> to_float(const TensorView& t) {
  const size_t n = numel(t.shape);
  std::vector<float> out(n);
  if (t.dtype == "F32") {
    if (n) std::memcpy(out.data(), t.data, n * 4);
  } else if (t.dtype == "F64") {
    for (size_t i = 0; i < n; ++i) {
      double d;
      std::memcpy(&d, t.data + 8 * i, 8);
      out[i] = static_cast<float>(d);
    }
  } else if (t.dtype == "F16") {
    for (size_t i = 0; i < n; ++i) {
      uint16_t h;
      std::memcpy(&h, t.data + 2 * i, 2);
      out[i] = half_to_float(h);
    }
  } else if (t.dtype == "BF16") {
    for (size_t i = 0; i < n; ++i) {
      uint16_t h;
      std::memcpy(&h, t.data + 2 * i, 2);
      const uint32_t bits = static_cast<uint32_t>(h) << 16;
      std::memcpy(&out[i], &bits, 4);
    }
  } else {
    throw std::runtime_error("tensor of dtype " + t.dtype + " is not floating point");
  }
  return out;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::vector<int64_t> parse_shape(const std::string& text, const std::string& name) {
  std::vector<int64_t> shape;
  size_t i = 0;
  while (i <= text.size()) {
    const size_t j = text.find(',', i);
    const std::string part = text.substr(i, j == std::string::npos ? std::string::npos : j - i);
    if (part.empty() || part.size() > 13 || part.find_first_not_of("0123456789") != std::string::npos)
      throw std::runtime_error("nf4_shape of " + name + " is not comma-separated dimensions");
    const int64_t d = std::stoll(part);
    if (d > (1ll << 40) - 1) throw std::runtime_error("nf4_shape of " + name + " has a dimension beyond 2^40-1");
    shape.push_back(d);
    numel(shape);  // throws beyond 2^62 elements
    if (j == std::string::npos) break;
    i = j + 1;
  }
  return shape;
}

}  // namespace

bool is_compressed(const std::vector<uint8_t>& p) { return p.size() >= 8 && std::memcmp(p.data(), kZMagic, 8) == 0; }

std::vector<uint8_t> inflate_payload(const std::vector<uint8_t>& payload, size_t max_bytes) {
  if (!is_compressed(payload)) throw std::runtime_error("payload is not compressed");
  z_stream z{};
  if (inflateInit(&z) != Z_OK) throw std::runtime_error("zlib failed to initialise");
  std::vector<uint8_t> out(std::min<size_t>(max_bytes, std::max<size_t>(payload.size() * 4, 1 << 16)));
  z.next_in = const_cast<Bytef*>(payload.data() + 8);
  z.avail_in = static_cast<uInt>(payload.size() - 8);
  size_t have = 0;
  int rc = Z_OK;
  while (rc != Z_STREAM_END) {
    if (have == out.size()) {
      if (out.size() >= max_bytes) {
        inflateEnd(&z);
        throw std::runtime_error("compressed payload inflates beyond its limit");
      }
      out.resize(std::min(max_bytes, out.size() * 2));
    }
    z.next_out = out.data() + have;
    z.avail_out = static_cast<uInt>(std::min<size_t>(out.size() - have, 1u << 30));
    const size_t before = z.avail_out;
    rc = inflate(&z, Z_NO_FLUSH);
    have += before - z.avail_out;
    if (rc == Z_BUF_ERROR && z.avail_in == 0) rc = Z_DATA_ERROR;  // truncated
    if (rc != Z_OK && rc != Z_STREAM_END && rc != Z_BUF_ERROR) {
      inflateEnd(&z);
      throw std::runtime_error("compressed payload is malformed or truncated");
    }
  }
  const bool trailing = z.avail_in != 0;
  inflateEnd(&z);
  if (trailing) throw std::runtime_error("bytes after the compressed payload's zlib stream");
  out.resize(have);
  return out;
}

std::vector<uint8_t> deflate_payload(const std::vector<uint8_t>& payload) {
  uLongf n = compressBound(payload.size());
  std::vector<uint8_t> out(8 + n);
  std::memcpy(out.data(), kZMagic, 8);
  if (compress2(out.data() + 8, &n, payload.data(), payload.size(), 6) != Z_OK)
    throw std::runtime_error("zlib compression failed");
  out.resize(8 + n);
  return out;
}

Decoded decode_payload(const std::vector<uint8_t>& payload, size_t max_bytes) {
  if (payload.size() > max_bytes) throw std::runtime_error("payload exceeds its limit");
  SafetensorsFile file(is_compressed(payload) ? inflate_payload(payload, max_bytes) : payload, "payload");
  const auto& meta = file.metadata();
  const auto& ts = file.tensors();
  std::string format = "fp32";
  if (auto it = meta.find("format"); it != meta.end()) format = it->second;
  if (format != "fp32" && format != "fp16" && format != "bf16" && format != "int8" && format != "nf4")
    throw std::runtime_error("payload format " + format + " is not a weight format");
  Decoded out;
  if (auto it = meta.find("fedmoe.encoding"); it != meta.end()) {
    if (it->second != "state" && it->second != "delta") throw std::runtime_error("unknown fedmoe.encoding " + it->second);
    out.encoding = it->second;
  }
  std::map<std::string, std::vector<int64_t>> nf4;
  for (const auto& [k, v] : meta)
    if (k.rfind("nf4_shape:", 0) == 0) nf4[k.substr(10)] = parse_shape(v, k.substr(10));
  if (!nf4.empty() && format != "nf4") throw std::runtime_error("nf4_shape metadata in a " + format + " payload");
  std::set<std::string> side;  // quantization side tensors, consumed by their owner
  for (const auto& [name, t] : ts) {
    if (ends_with(name, "::scale") || ends_with(name, "::absmax")) continue;
    FloatTensor f;
    if (auto q = nf4.find(name); q != nf4.end()) {
      const uint64_t n = numel(q->second);
      const auto absmax = ts.find(name + "::absmax");
      if (t.dtype != "U8" || t.shape != std::vector<int64_t>{static_cast<int64_t>((n + 1) / 2)} || absmax == ts.end() ||
          absmax->second.dtype != "F32" ||
          absmax->second.shape != std::vector<int64_t>{static_cast<int64_t>((n + 63) / 64)})
        throw std::runtime_error("nf4 tensor " + name + " lacks its packed data or absmax of the right shapes");
      side.insert(name + "::absmax");
      const auto am = to_float(absmax->second);
      f.shape = q->second;
      f.data.resize(n);
      for (uint64_t i = 0; i < n; ++i) {
        const uint8_t byte = t.data[i / 2];
        const int idx = (i % 2 == 0) ? (byte >> 4) : (byte & 0x0f);
        f.data[i] = kNF4[idx] * am[i / 64];
      }
    } else if (t.dtype == "I8") {
      const auto sc = ts.find(name + "::scale");
      if (format != "int8" || sc == ts.end() || sc->second.dtype != "F32" || t.shape.size() < 2)
        throw std::runtime_error("int8 tensor " + name + " lacks its F32 scale (or the payload is not int8)");
      side.insert(name + "::scale");
      const auto s = to_float(sc->second);
      const int64_t rows = t.shape[0], n = static_cast<int64_t>(numel(t.shape));
      const int64_t cols = rows ? n / rows : 0;
      if (rows * cols != n || (n && !cols)) throw std::runtime_error("int8 tensor " + name + " has an empty row");
      const bool per_row = sc->second.shape == std::vector<int64_t>{rows};
      const bool per_col = t.shape.size() == 2 && sc->second.shape == std::vector<int64_t>{1, t.shape[1]};
      if (!per_row && !per_col) throw std::runtime_error("int8 scale of " + name + " has neither row nor column shape");
      f.shape = t.shape;
      f.data.resize(static_cast<size_t>(n));
      const auto* q8 = reinterpret_cast<const int8_t*>(t.data);
      for (int64_t i = 0; i < n; ++i)
        f.data[static_cast<size_t>(i)] = static_cast<float>(q8[i]) * (per_row ? s[static_cast<size_t>(i / cols)]
                                                                               : s[static_cast<size_t>(i % cols)]);
    } else if (t.dtype == "F32" || t.dtype == "F16" || t.dtype == "BF16" || t.dtype == "F64") {
      f.shape = t.shape;
      f.data = to_float(t);
    } else {
      throw std::runtime_error("tensor " + name + " of dtype " + t.dtype + " is not adapter state");
    }
    for (float x : f.data)
      if (!std::isfinite(x)) throw std::runtime_error("tensor " + name + " holds NaN or infinity");
    out.tensors.emplace(name, std::move(f));
  }
  for (const auto& [name, t] : ts)
    if ((ends_with(name, "::scale") || ends_with(name, "::absmax")) && !side.count(name))
      throw std::runtime_error("side tensor " + name + " belongs to no quantized tensor");
  for (const auto& [name, _] : nf4)
    if (!ts.count(name)) throw std::runtime_error("nf4_shape names a missing tensor " + name);
  return out;
}

std::vector<uint8_t> encode_fp32(const FloatTensors& tensors, bool compress) {
  std::map<std::string, TensorView> views;
  for (const auto& [name, t] : tensors)
    views[name] = TensorView{"F32", t.shape, reinterpret_cast<uint8_t*>(const_cast<float*>(t.data.data())),
                             t.data.size() * 4};
  auto bytes = safetensors_bytes(views, {{"format", "fp32"}, {"fedmoe.encoding", "state"}});
  return compress ? deflate_payload(bytes) : bytes;
}

}  // namespace fedmoe
