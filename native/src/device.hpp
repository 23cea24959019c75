// The native (phone-class) device: joins a federation over MQTT and trains its sub-MoE with
// the training program the cloud serves (PROTOCOL.md §4, §6.4b), without Python. This is the
// part an Android (JNI) or iOS (Objective-C++) wrapper embeds: construct a Device with its
// configuration and call run() on a thread of its own; stop() (any thread) ends it.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "mqtt.hpp"

namespace fedmoe {

struct DeviceConfig {
  std::string device_id;
  std::string federation;
  std::string task;
  uint64_t budget_bytes = 0;                        // footprint budget (§5.3a)
  std::vector<std::string> weight_formats = {"int8"};
  std::string data_path;                            // token ids: `fedmoe data tokens` writes it
  std::string cache_dir;                            // verified shards, programs (by sha256)
  std::string signing_key;                          // base64 Ed25519 seed; empty: unsigned
  uint64_t seed = 0;                                // local shuffling (as EdgeClient's seed)
  double val_fraction = 0.2;                        // held out for validation (as EdgeClient's)
  uint64_t headroom_bytes = 8ull << 20;             // added to the measured baseline
  double hello_timeout_s = 60;
  bool exit_when_no_aggregator = false;
  int max_rounds = 0;                               // 0: until the cloud says stop
  double idle_timeout_s = 0;                        // 0: wait for assignments forever
  bool single_thread = false;                       // train on run()'s thread only (ExecuTorch's threadpool off)
  MqttOptions mqtt;                                 // url, TLS, username/password, protocol
};

/// What one served round did (the device's history).
struct RoundSummary {
  uint64_t round = 0;
  double train_loss = 0, val_accuracy = -1, seconds = 0;
  uint64_t peak_footprint = 0, predicted_peak = 0, bytes_up = 0, bytes_down = 0, steps = 0;
};

class Device {
 public:
  /// Reads the data file and measures the baseline; throws std::runtime_error on bad data.
  explicit Device(DeviceConfig config);
  ~Device();
  /// Serves rounds until the cloud says stop, stop() is called, `max_rounds` are done or
  /// the idle timeout passes; returns the exit status (0, or 3 when no aggregator answered
  /// and `exit_when_no_aggregator`). Throws std::runtime_error when it cannot connect.
  int run();
  /// Ends run() at the next step or message (safe from a signal handler's thread).
  void stop() { stop_ = true; }
  const std::vector<RoundSummary>& history() const { return history_; }
  uint64_t runtime_bytes() const { return runtime_bytes_; }

 private:
  struct Data;
  struct Held;
  void handle(const Message& m);
  void serve(const std::vector<uint8_t>& payload);
  void train_round(const struct Assignment& a);
  std::vector<uint8_t> await_state(const struct Assignment& a);
  void tell(const struct Assignment& a, const std::string& reason);
  void ack(uint64_t round, uint64_t attempt, bool accepted, const std::string& reason = "",
           std::optional<uint64_t> budget = std::nullopt, std::optional<uint64_t> needed = std::nullopt);
  std::string topic(const std::string& kind, const std::optional<std::string>& uplink = std::nullopt) const;

  DeviceConfig cfg_;
  std::unique_ptr<Data> data_;
  std::unique_ptr<Held> held_;
  std::unique_ptr<Mqtt> mqtt_;
  std::atomic<bool> stop_{false};
  uint64_t runtime_bytes_ = 0;
  std::pair<uint64_t, uint64_t> last_ = {0, 0};
  bool served_any_ = false, answered_ = false;
  std::vector<Message> pending_;  // messages put aside while a round waits for its state
  struct StateBlob {
    uint64_t round = 0;
    std::vector<uint8_t> data;
  };
  std::map<std::string, StateBlob> states_;  // state blobs by transfer id
  std::vector<std::string> state_order_;     // their arrival order (the oldest is dropped first)
  void keep_state(const std::string& id, uint64_t round, std::vector<uint8_t> data);
  void poll_commands();
  std::vector<RoundSummary> history_;
  uint64_t mark_sent_ = 0, mark_received_ = 0, mark_downloaded_ = 0;
};

}  // namespace fedmoe
