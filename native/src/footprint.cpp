#include "footprint.hpp"

#include <chrono>
#include <cstdio>
#include <cstring>

namespace fedmoe {

namespace {
void read_status(uint64_t* foot, uint64_t* rss) {
  *foot = *rss = 0;
  std::FILE* f = std::fopen("/proc/self/status", "r");
  if (!f) return;
  char line[256];
  unsigned long kib = 0;
  while (std::fgets(line, sizeof line, f)) {
    if (std::sscanf(line, "RssAnon: %lu kB", &kib) == 1 || std::sscanf(line, "RssShmem: %lu kB", &kib) == 1 ||
        std::sscanf(line, "VmSwap: %lu kB", &kib) == 1)
      *foot += kib * 1024ull;
    else if (std::sscanf(line, "VmRSS: %lu kB", &kib) == 1)
      *rss = kib * 1024ull;
  }
  std::fclose(f);
}
void keep_max(std::atomic<uint64_t>& a, uint64_t v) {
  uint64_t cur = a.load();
  while (v > cur && !a.compare_exchange_weak(cur, v)) {
  }
}
}  // namespace

uint64_t footprint_bytes() {
  uint64_t f, r;
  read_status(&f, &r);
  return f;
}

uint64_t rss_bytes() {
  uint64_t f, r;
  read_status(&f, &r);
  return r;
}

void PeakMeter::start() {
  stop();
  foot_ = rss_ = 0;
  mark();
  run_ = true;
  thread_ = std::thread([this] {
    while (run_) {
      mark();
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  });
}

void PeakMeter::mark() {
  uint64_t f, r;
  read_status(&f, &r);
  keep_max(foot_, f);
  keep_max(rss_, r);
}

void PeakMeter::stop() {
  run_ = false;
  if (thread_.joinable()) thread_.join();
  mark();
}

}  // namespace fedmoe
