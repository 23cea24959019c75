// Blobs as chunk messages (PROTOCOL.md §6.1-§6.3): `FMC1`, a 4-byte big-endian header
// length, a closed JSON header {id, kind, round, seq, n, size, sha, csha}, then the data.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace fedmoe {

/// Data bytes per chunk for chunk messages of at most `max_payload` bytes (512 reserved for
/// magic, length and header); throws std::runtime_error below 1536.
size_t chunk_data_bytes(size_t max_payload);

/// The chunk messages of `data` (in seq order, at least one) and, in `sha`, its sha256.
std::vector<std::vector<uint8_t>> split_blob(const std::vector<uint8_t>& data, size_t max_payload,
                                             const std::string& id, const std::string& kind, uint64_t round,
                                             std::string* sha);

/// A header of one chunk message.
struct ChunkHeader {
  std::string id, kind, sha, csha;
  uint64_t round = 0, seq = 0, n = 0, size = 0;
};

/// Parses and checks one chunk message (§6.3 step 1: magic, header length, the closed header
/// with strict types, `size <= max_blob`, `seq < n <= max(1, size)`, the data's sha256);
/// returns the header, and the data's offset and length in `payload`. Throws
/// std::runtime_error with the reason.
ChunkHeader parse_chunk(const std::vector<uint8_t>& payload, size_t max_blob, size_t* data_at, size_t* data_len);

/// A completed blob.
struct Blob {
  ChunkHeader header;  // of its first chunk (seq and csha of that chunk)
  std::vector<uint8_t> data;
};

/// Reassembles blobs of one sender (§6.3): keyed by (round, id); duplicates ignored, a
/// conflicting chunk or a blob whose sha256 differs drops its transfer (and throws); at most
/// `max_pending` transfers in progress (oldest dropped); completed ids remembered.
class Reassembler {
 public:
  explicit Reassembler(size_t max_blob, size_t max_pending = 16) : max_blob_(max_blob), max_pending_(max_pending) {}
  /// Adds one chunk message; returns the blob when it completed it. Throws on a bad chunk.
  std::optional<Blob> add(const std::vector<uint8_t>& payload);

 private:
  struct Pending {
    ChunkHeader first;
    std::map<uint64_t, std::vector<uint8_t>> parts;
    size_t bytes = 0;
    uint64_t order = 0;
  };
  size_t max_blob_, max_pending_;
  uint64_t next_ = 0;
  std::map<std::pair<uint64_t, std::string>, Pending> pending_;
  std::set<std::pair<uint64_t, std::string>> done_;
  std::deque<std::pair<uint64_t, std::string>> done_order_;
};

}  // namespace fedmoe
