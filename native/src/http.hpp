// Content-addressed files over HTTP (PROTOCOL.md §6.4a, §6.4b), through libcurl: base shards,
// training programs, their manifests and LoRA A factors, fetched by `Range` windows into a
// file beside the cache and used only when their size and sha256 match.
#pragma once

#include <cstdint>
#include <string>

namespace fedmoe {

/// A directory of verified files named `{sha256}{suffix}`.
class FileCache {
 public:
  explicit FileCache(std::string directory);
  /// The path of the verified file of `sha256` (downloaded from `url` first when it is not
  /// here: windows of 8 MiB, 206 with exactly the window's Content-Range, or a 200 carrying
  /// the whole file for the first request; a short answer resumed up to 3 times). Throws
  /// std::runtime_error when `bytes` exceeds `max_bytes`, the transfer fails, or the bytes'
  /// count or sha256 differ (nothing of them is kept).
  std::string fetch(const std::string& url, const std::string& sha256, uint64_t bytes, const std::string& suffix,
                    uint64_t max_bytes, double timeout_s);
  /// Bytes downloaded since construction.
  uint64_t downloaded() const { return downloaded_; }
  const std::string& directory() const { return dir_; }

 private:
  std::string dir_;
  uint64_t downloaded_ = 0;
};

}  // namespace fedmoe
