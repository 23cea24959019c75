// The native device's log: one line per event on stderr, `HH:MM:SS LEVEL fedmoe-device: ...`,
// as the Python side's logging writes them; warnings of one kind at most once a minute with a
// count of those left out, so a flood of bad input cannot flood the log.
#pragma once

#include <string>

namespace fedmoe::log {

enum class Level { debug = 10, info = 20, warning = 30, error = 40 };

/// Sets the lowest level written (default info).
void set_level(Level level);
/// Writes `message` at `level`.
void write(Level level, const std::string& message);
inline void debug(const std::string& m) { write(Level::debug, m); }
inline void info(const std::string& m) { write(Level::info, m); }
inline void error(const std::string& m) { write(Level::error, m); }
/// A warning of kind `key`: written at most once per 60 s per key; the next one written
/// says how many were left out.
void warning(const std::string& key, const std::string& message);

}  // namespace fedmoe::log
