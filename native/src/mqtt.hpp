// One MQTT connection of the native device, over libmosquitto (Eclipse Mosquitto's client
// library): MQTT 5 (or 3.1.1, with the user-properties envelope of PROTOCOL.md §8.1), QoS 1,
// a retained Will, subscriptions and a birth message renewed on every reconnect (§2.2),
// publishes that wait for their PUBACK and fail on a failure reason code (§2.3), and the
// packet sizes each way (Stats.bytes_up/bytes_down).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

struct mosquitto;

namespace fedmoe {

using Properties = std::map<std::string, std::string>;

/// A received message: topic, payload (the envelope opened) and user properties.
struct Message {
  std::string topic;
  std::vector<uint8_t> payload;
  Properties properties;
  bool retain = false;
};

struct MqttOptions {
  std::string url;        // mqtt://host[:1883] or mqtts://host[:8883]
  std::string client_id;  // dev-{device_id}
  std::string username, password;
  std::string tls_ca, tls_cert, tls_key;  // mqtts: CA file (required), optional client certificate
  std::string protocol = "5";             // "5" or "3.1.1"
  int keepalive_s = 30;
  std::string will_topic, will_payload;   // retained, QoS 1
  size_t max_payload = 256 * 1024;        // largest payload published (chunks are cut below it)
  double connect_timeout_s = 30;
};

/// Thrown when a publish fails (a failure reason code, no PUBACK in time, no connection).
struct PublishError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class Mqtt {
 public:
  /// Connects (retrying until `connect_timeout_s`) and starts the network thread; throws
  /// std::runtime_error when the URL is malformed or no connection came up in time.
  explicit Mqtt(const MqttOptions& options);
  ~Mqtt();  // a normal DISCONNECT (which suppresses the Will)
  Mqtt(const Mqtt&) = delete;
  Mqtt& operator=(const Mqtt&) = delete;

  /// Subscribes at QoS 1 now and after every reconnect.
  void subscribe(const std::string& filter);
  /// A retained message published now and after every reconnect (the `online` status).
  void set_birth(const std::string& topic, const std::string& payload);
  /// Publishes at QoS 1 and waits up to `timeout_s` for its PUBACK; throws PublishError.
  void publish(const std::string& topic, const std::vector<uint8_t>& payload, bool retain = false,
               const Properties& properties = {}, double timeout_s = 60);
  void publish(const std::string& topic, const std::string& payload, bool retain = false,
               const Properties& properties = {}, double timeout_s = 60) {
    publish(topic, std::vector<uint8_t>(payload.begin(), payload.end()), retain, properties, timeout_s);
  }
  /// Publishes every payload at QoS 1 on one topic, then waits for all their PUBACKs.
  void publish_all(const std::string& topic, const std::vector<std::vector<uint8_t>>& payloads,
                   const Properties& properties, double timeout_s = 120);
  /// The next received message, waiting up to `timeout_s`; none when the time ran out.
  std::optional<Message> get(double timeout_s);

  /// Largest payload to publish: the configured one, lowered to the broker's Maximum Packet
  /// Size - 1024 when its CONNACK announced one.
  size_t max_payload() const { return max_payload_.load(); }
  bool v5() const { return v5_; }
  /// PUBLISH packet bytes sent and received so far.
  uint64_t bytes_sent() const { return sent_; }
  uint64_t bytes_received() const { return received_; }
  /// Size in bytes of a PUBLISH packet (QoS 1) with `props_len` bytes of MQTT 5 properties.
  static uint64_t packet_bytes(const std::string& topic, size_t payload_len, bool v5, size_t props_len);

  // libmosquitto's callbacks (public for the C trampolines)
  void on_connect(int rc, const void* props);
  void on_disconnect(int rc);
  void on_publish(int mid, int reason);
  void on_message(const void* msg, const void* props);

 private:
  int publish_one(const std::string& topic, const std::vector<uint8_t>& payload, bool retain, const Properties& props);
  void wait(const std::set<int>& mids, double timeout_s);
  mosquitto* m_ = nullptr;
  bool v5_ = true;
  std::atomic<size_t> max_payload_;
  size_t inbox_bytes_ = 0;
  std::set<int> unwaited_;  // message ids nobody waits for (the birth message): their PUBACKs are dropped
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Message> inbox_;
  std::set<std::string> subs_;
  std::string birth_topic_, birth_payload_;
  std::map<int, int> acks_;  // mid -> reason code, once acknowledged
  bool connected_ = false;
  int connect_rc_ = -1;
  std::atomic<uint64_t> sent_{0}, received_{0};
};

}  // namespace fedmoe
