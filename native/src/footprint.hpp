// The device's memory as PROTOCOL.md §5.3a counts it: footprint = RssAnon + RssShmem +
// VmSwap of /proc/self/status (anonymous and shared-memory resident pages, and swapped-out
// pages; clean file-backed pages, which RSS also counts, are left out), and its peak over a
// round, sampled every 10 ms by a thread and at every mark.
#pragma once

#include <atomic>
#include <cstdint>
#include <thread>

namespace fedmoe {

/// Footprint now (bytes; 0 where /proc is not there).
uint64_t footprint_bytes();
/// Resident set now (bytes).
uint64_t rss_bytes();

/// The peak footprint and RSS between start() and stop().
class PeakMeter {
 public:
  PeakMeter() = default;
  ~PeakMeter() { stop(); }
  void start();
  void mark();  // one sample now
  void stop();
  uint64_t peak_footprint() const { return foot_; }
  uint64_t peak_rss() const { return rss_; }

 private:
  std::atomic<uint64_t> foot_{0}, rss_{0};
  std::atomic<bool> run_{false};
  std::thread thread_;
};

}  // namespace fedmoe
