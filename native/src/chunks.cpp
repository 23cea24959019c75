#include "chunks.hpp"

#include <cstring>
#include <cctype>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "crypto.hpp"
#include "messages.hpp"

namespace fedmoe {

namespace {
constexpr size_t kReserve = 512;  // magic + length + header (protocol/chunking.py HEADER_RESERVE)
constexpr size_t kMaxHeader = 2048;
constexpr uint64_t kMaxChunks = 1000000;

bool is_kind(const std::string& s) {
  if (s.empty() || s.size() > 32) return false;
  for (char c : s)
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' || c == '.' || c == '-')) return false;
  return true;
}
}  // namespace

size_t chunk_data_bytes(size_t max_payload) {
  if (max_payload < kReserve + 1024) throw std::runtime_error("chunk payload limit too small");
  return max_payload - kReserve;
}

std::vector<std::vector<uint8_t>> split_blob(const std::vector<uint8_t>& data, size_t max_payload,
                                             const std::string& id, const std::string& kind, uint64_t round,
                                             std::string* sha) {
  const size_t step = chunk_data_bytes(max_payload);
  const size_t n = std::max<size_t>(1, (data.size() + step - 1) / step);
  const std::string whole = sha256_hex(data);
  if (sha) *sha = whole;
  std::vector<std::vector<uint8_t>> out;
  out.reserve(n);
  for (size_t seq = 0; seq < n; ++seq) {
    const size_t a = seq * step, len = std::min(step, data.size() - std::min(a, data.size()));
    nlohmann::ordered_json h = {{"id", id},   {"kind", kind}, {"round", round},    {"seq", seq},
                                {"n", n},     {"size", data.size()}, {"sha", whole},
                                {"csha", sha256_hex(data.data() + a, len)}};
    const std::string hs = h.dump();
    std::vector<uint8_t> msg(8 + hs.size() + len);
    std::memcpy(msg.data(), "FMC1", 4);
    const uint32_t hl = static_cast<uint32_t>(hs.size());
    for (int i = 0; i < 4; ++i) msg[4 + i] = static_cast<uint8_t>(hl >> (24 - 8 * i));
    std::memcpy(msg.data() + 8, hs.data(), hs.size());
    if (len) std::memcpy(msg.data() + 8 + hs.size(), data.data() + a, len);
    if (msg.size() > max_payload) throw std::runtime_error("chunk header exceeded its reserve");
    out.push_back(std::move(msg));
  }
  return out;
}

ChunkHeader parse_chunk(const std::vector<uint8_t>& p, size_t max_blob, size_t* data_at, size_t* data_len) {
  if (p.size() < 8 || std::memcmp(p.data(), "FMC1", 4) != 0) throw std::runtime_error("not a chunk message");
  uint32_t hl = 0;
  for (int i = 0; i < 4; ++i) hl = (hl << 8) | p[4 + i];
  if (hl > kMaxHeader || 8 + static_cast<size_t>(hl) > p.size()) throw std::runtime_error("chunk header length out of range");
  nlohmann::json h;
  try {
    h = nlohmann::json::parse(p.begin() + 8, p.begin() + 8 + hl);
  } catch (const nlohmann::json::exception&) {
    throw std::runtime_error("chunk header is not JSON");
  }
  static const std::set<std::string> members = {"id", "kind", "round", "seq", "n", "size", "sha", "csha"};
  if (!h.is_object() || h.size() != members.size()) throw std::runtime_error("chunk header members differ");
  for (const auto& [k, v] : h.items())
    if (!members.count(k)) throw std::runtime_error("chunk header has an unknown member " + k);
  ChunkHeader c;
  for (const char* k : {"id", "kind", "sha", "csha"})
    if (!h[k].is_string()) throw std::runtime_error(std::string("chunk header ") + k + " is not a string");
  for (const char* k : {"round", "seq", "n", "size"})
    if (!h[k].is_number_unsigned()) throw std::runtime_error(std::string("chunk header ") + k + " is not an integer >= 0");
  c.id = h["id"];
  c.kind = h["kind"];
  c.sha = h["sha"];
  c.csha = h["csha"];
  c.round = h["round"];
  c.seq = h["seq"];
  c.n = h["n"];
  c.size = h["size"];
  if (!is_id(c.id) || !is_kind(c.kind) || !is_hex64(c.sha) || !is_hex64(c.csha))
    throw std::runtime_error("chunk header id, kind or sha256 malformed");
  if (c.size > max_blob) throw std::runtime_error("blob of " + std::to_string(c.size) + " bytes exceeds the limit");
  if (c.n < 1 || c.n > kMaxChunks || c.n > std::max<uint64_t>(1, c.size) || c.seq >= c.n)
    throw std::runtime_error("chunk seq or count out of range");
  *data_at = 8 + hl;
  *data_len = p.size() - *data_at;
  if (sha256_hex(p.data() + *data_at, *data_len) != c.csha) throw std::runtime_error("chunk data fails its sha256");
  return c;
}

std::optional<Blob> Reassembler::add(const std::vector<uint8_t>& payload) {
  size_t at = 0, len = 0;
  const ChunkHeader c = parse_chunk(payload, max_blob_, &at, &len);
  const auto key = std::make_pair(c.round, c.id);
  if (done_.count(key)) return std::nullopt;  // a transfer completed earlier
  auto it = pending_.find(key);
  if (it == pending_.end()) {
    if (pending_.size() >= max_pending_) {  // drop the oldest incomplete transfer
      auto oldest = pending_.begin();
      for (auto j = pending_.begin(); j != pending_.end(); ++j)
        if (j->second.order < oldest->second.order) oldest = j;
      pending_.erase(oldest);
    }
    it = pending_.emplace(key, Pending{c, {}, 0, next_++}).first;
  }
  Pending& t = it->second;
  if (t.first.kind != c.kind || t.first.n != c.n || t.first.size != c.size || t.first.sha != c.sha) {
    pending_.erase(it);
    throw std::runtime_error("chunk disagrees with its transfer's first chunk");
  }
  std::vector<uint8_t> data(payload.begin() + static_cast<long>(at), payload.begin() + static_cast<long>(at + len));
  if (auto p = t.parts.find(c.seq); p != t.parts.end()) {
    if (p->second != data) {
      pending_.erase(it);
      throw std::runtime_error("a chunk of the same seq with other data");
    }
    return std::nullopt;
  }
  t.bytes += data.size();
  if (t.bytes > t.first.size) {
    pending_.erase(it);
    throw std::runtime_error("chunks exceed the blob's size");
  }
  t.parts.emplace(c.seq, std::move(data));
  if (t.parts.size() < t.first.n) return std::nullopt;
  Blob b{t.first, {}};
  b.data.reserve(t.bytes);
  for (auto& [_, part] : t.parts) b.data.insert(b.data.end(), part.begin(), part.end());
  pending_.erase(it);
  if (b.data.size() != b.header.size || sha256_hex(b.data) != b.header.sha)
    throw std::runtime_error("reassembled blob fails its size or sha256");
  done_.insert(key);
  done_order_.push_back(key);
  if (done_order_.size() > 10000) {  // forget the oldest completed transfer
    done_.erase(done_order_.front());
    done_order_.pop_front();
  }
  return b;
}

}  // namespace fedmoe
