#include "log.hpp"

#include <chrono>
#include <cstdio>
#include <ctime>
#include <map>
#include <mutex>

namespace fedmoe::log {

namespace {
std::mutex mu;
Level lowest = Level::info;
struct Seen {
  std::chrono::steady_clock::time_point at;
  long dropped = 0;
};
std::map<std::string, Seen> seen;

const char* name(Level l) {
  switch (l) {
    case Level::debug: return "DEBUG";
    case Level::info: return "INFO";
    case Level::warning: return "WARNING";
    default: return "ERROR";
  }
}
void emit(Level level, const std::string& m) {
  const std::time_t t = std::time(nullptr);
  char ts[16];
  std::strftime(ts, sizeof ts, "%H:%M:%S", std::localtime(&t));
  std::fprintf(stderr, "%s %-7s fedmoe-device: %s\n", ts, name(level), m.c_str());
  std::fflush(stderr);
}
}  // namespace

void set_level(Level level) {
  std::lock_guard<std::mutex> g(mu);
  lowest = level;
}

void write(Level level, const std::string& message) {
  std::lock_guard<std::mutex> g(mu);
  if (level >= lowest) emit(level, message);
}

void warning(const std::string& key, const std::string& message) {
  std::lock_guard<std::mutex> g(mu);
  const auto now = std::chrono::steady_clock::now();
  auto it = seen.find(key);
  if (it != seen.end() && now - it->second.at < std::chrono::seconds(60)) {
    ++it->second.dropped;
    return;
  }
  const long dropped = it == seen.end() ? 0 : it->second.dropped;
  seen[key] = Seen{now, 0};
  if (seen.size() > 1000) seen.erase(seen.begin());
  emit(Level::warning, dropped ? message + " (" + std::to_string(dropped) + " more like it left out)" : message);
}

}  // namespace fedmoe::log
