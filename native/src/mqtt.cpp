#include "mqtt.hpp"

#include <mosquitto.h>
#include <mqtt_protocol.h>

#include <chrono>
#include <cstring>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <thread>

#include "log.hpp"

namespace fedmoe {

namespace {

constexpr size_t kInboxMax = 10000;
constexpr size_t kInboxMaxBytes = 1ull << 30;  // beyond: messages dropped (and logged)

template <class F>
void guarded(const char* what, F f) {  // no exception may unwind through libmosquitto's C frames
  try {
    f();
  } catch (const std::exception& e) {
    fedmoe::log::warning(std::string("callback-") + what, std::string("MQTT ") + what + " callback failed: " + e.what());
  } catch (...) {
    fedmoe::log::warning(std::string("callback-") + what, std::string("MQTT ") + what + " callback failed");
  }
}

size_t varint_len(size_t n) {
  size_t k = 1;
  while (n >= 128) n >>= 7, ++k;
  return k;
}

size_t props_len(const Properties& p) {
  size_t n = 0;
  for (const auto& [k, v] : p) n += 1 + 2 + k.size() + 2 + v.size();
  return n;
}

struct Url {
  bool tls = false;
  std::string host;
  int port = 1883;
};

Url parse_url(const std::string& url) {
  Url u;
  std::string rest;
  if (url.rfind("mqtt://", 0) == 0) {
    rest = url.substr(7);
  } else if (url.rfind("mqtts://", 0) == 0) {
    rest = url.substr(8), u.tls = true, u.port = 8883;
  } else {
    throw std::runtime_error("broker URL " + url + ": want mqtt://host[:port] or mqtts://host[:port]");
  }
  if (rest.find(',') != std::string::npos)
    throw std::runtime_error("broker URL " + url + ": the native device connects to one node (no cluster list)");
  if (const auto slash = rest.find('/'); slash != std::string::npos) rest = rest.substr(0, slash);
  if (const auto colon = rest.rfind(':'); colon != std::string::npos) {
    u.port = std::stoi(rest.substr(colon + 1));
    rest = rest.substr(0, colon);
  }
  if (rest.empty() || u.port < 1 || u.port > 65535) throw std::runtime_error("broker URL " + url + ": no host or bad port");
  u.host = rest;
  return u;
}

// §8.1: "FMP1" | uint16 big-endian n | n bytes of JSON {name: value} | payload
std::vector<uint8_t> wrap(const std::vector<uint8_t>& payload, const Properties& props) {
  const std::string j = nlohmann::json(props).dump();
  if (j.size() > 4096) throw std::runtime_error("user properties exceed the envelope's 4096 bytes");
  std::vector<uint8_t> out(6 + j.size() + payload.size());
  std::memcpy(out.data(), "FMP1", 4);
  out[4] = static_cast<uint8_t>(j.size() >> 8);
  out[5] = static_cast<uint8_t>(j.size() & 0xff);
  std::memcpy(out.data() + 6, j.data(), j.size());
  if (!payload.empty()) std::memcpy(out.data() + 6 + j.size(), payload.data(), payload.size());
  return out;
}

bool unwrap(std::vector<uint8_t>& payload, Properties& props) {
  if (payload.size() < 6 || std::memcmp(payload.data(), "FMP1", 4) != 0) return false;
  const size_t n = (static_cast<size_t>(payload[4]) << 8) | payload[5];
  if (n > 4096 || 6 + n > payload.size()) return false;
  try {
    const auto j = nlohmann::json::parse(payload.begin() + 6, payload.begin() + 6 + static_cast<long>(n));
    if (!j.is_object()) return false;
    Properties p;
    for (const auto& [k, v] : j.items()) {
      if (!v.is_string()) return false;
      p[k] = v.get<std::string>();
    }
    for (auto& [k, v] : p) props.emplace(k, v);  // MQTT 5 properties, where present, win
  } catch (const nlohmann::json::exception&) {
    return false;
  }
  payload.erase(payload.begin(), payload.begin() + 6 + static_cast<long>(n));
  return true;
}

Mqtt* self(void* obj) { return static_cast<Mqtt*>(obj); }

}  // namespace

uint64_t Mqtt::packet_bytes(const std::string& topic, size_t payload_len, bool v5, size_t plen) {
  size_t remaining = 2 + topic.size() + 2 + payload_len;
  if (v5) remaining += varint_len(plen) + plen;
  return 1 + varint_len(remaining) + remaining;
}

Mqtt::Mqtt(const MqttOptions& o) : v5_(o.protocol != "3.1.1"), max_payload_(o.max_payload) {
  if (o.protocol != "5" && o.protocol != "3.1.1") throw std::runtime_error("MQTT protocol must be 5 or 3.1.1");
  const Url u = parse_url(o.url);
  mosquitto_lib_init();
  m_ = mosquitto_new(o.client_id.c_str(), true, this);
  if (!m_) throw std::runtime_error("mosquitto_new failed");
  mosquitto_int_option(m_, MOSQ_OPT_PROTOCOL_VERSION, v5_ ? MQTT_PROTOCOL_V5 : MQTT_PROTOCOL_V311);
  if (!o.username.empty()) mosquitto_username_pw_set(m_, o.username.c_str(), o.password.empty() ? nullptr : o.password.c_str());
  if (u.tls) {
    if (o.tls_ca.empty()) throw std::runtime_error("mqtts:// needs a CA file (--tls-ca)");
    if (mosquitto_tls_set(m_, o.tls_ca.c_str(), nullptr, o.tls_cert.empty() ? nullptr : o.tls_cert.c_str(),
                          o.tls_key.empty() ? nullptr : o.tls_key.c_str(), nullptr) != MOSQ_ERR_SUCCESS)
      throw std::runtime_error("TLS settings refused (CA, certificate or key file)");
  }
  if (!o.will_topic.empty())
    mosquitto_will_set_v5(m_, o.will_topic.c_str(), static_cast<int>(o.will_payload.size()), o.will_payload.data(), 1,
                          true, nullptr);
  mosquitto_connect_v5_callback_set(m_, [](mosquitto*, void* obj, int rc, int, const mosquitto_property* p) {
    guarded("connect", [&] { self(obj)->on_connect(rc, p); });
  });
  mosquitto_disconnect_v5_callback_set(m_, [](mosquitto*, void* obj, int rc, const mosquitto_property*) {
    guarded("disconnect", [&] { self(obj)->on_disconnect(rc); });
  });
  mosquitto_publish_v5_callback_set(m_, [](mosquitto*, void* obj, int mid, int reason, const mosquitto_property*) {
    guarded("publish", [&] { self(obj)->on_publish(mid, reason); });
  });
  mosquitto_message_v5_callback_set(m_, [](mosquitto*, void* obj, const mosquitto_message* msg, const mosquitto_property* p) {
    guarded("message", [&] { self(obj)->on_message(msg, p); });
  });
  mosquitto_reconnect_delay_set(m_, 1, 30, true);
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(o.connect_timeout_s);
  int rc;
  while ((rc = mosquitto_connect_bind_v5(m_, u.host.c_str(), u.port, o.keepalive_s, nullptr, nullptr)) != MOSQ_ERR_SUCCESS) {
    if (std::chrono::steady_clock::now() > end)
      throw std::runtime_error("cannot connect to " + o.url + ": " + mosquitto_strerror(rc));
    log::warning("connect", "cannot connect to " + o.url + " (" + mosquitto_strerror(rc) + "); retrying");
    std::this_thread::sleep_for(std::chrono::seconds(1));
  }
  mosquitto_loop_start(m_);
  std::unique_lock<std::mutex> g(mu_);
  if (!cv_.wait_until(g, end, [&] { return connected_ || connect_rc_ > 0; }) || !connected_) {
    g.unlock();
    const int why = connect_rc_;
    mosquitto_loop_stop(m_, true);
    throw std::runtime_error("no CONNACK from " + o.url +
                             (why > 0 ? std::string(": ") + mosquitto_reason_string(why) : std::string(" in time")));
  }
}

Mqtt::~Mqtt() {
  if (!m_) return;
  mosquitto_disconnect_v5(m_, 0, nullptr);
  mosquitto_loop_stop(m_, false);
  mosquitto_destroy(m_);
}

void Mqtt::on_connect(int rc, const void* props) {
  if (rc != 0) {
    log::warning("connack", std::string("the broker refused the connection: ") + mosquitto_reason_string(rc));
    std::lock_guard<std::mutex> g(mu_);
    connect_rc_ = rc;
    cv_.notify_all();
    return;
  }
  uint32_t most = 0;
  if (props && mosquitto_property_read_int32(static_cast<const mosquitto_property*>(props), MQTT_PROP_MAXIMUM_PACKET_SIZE,
                                             &most, false) && most > 1024)
    max_payload_ = std::min<size_t>(max_payload_.load(), most - 1024);
  std::set<std::string> subs;
  std::string bt, bp;
  {
    std::lock_guard<std::mutex> g(mu_);
    subs = subs_, bt = birth_topic_, bp = birth_payload_;
  }
  for (const auto& s : subs) mosquitto_subscribe_v5(m_, nullptr, s.c_str(), 1, 0, nullptr);
  try {  // the birth message (§2.2); nobody waits for its PUBACK
    if (!bt.empty()) {
      const int mid = publish_one(bt, std::vector<uint8_t>(bp.begin(), bp.end()), true, {});
      std::lock_guard<std::mutex> g(mu_);
      if (acks_.erase(mid) == 0) unwaited_.insert(mid);
    }
  } catch (const std::exception& e) {
    log::warning("birth", std::string("could not publish the online status: ") + e.what());
  }
  std::lock_guard<std::mutex> g(mu_);
  connected_ = true;
  cv_.notify_all();
  log::debug("connected to the broker");
}

void Mqtt::on_disconnect(int rc) {
  std::lock_guard<std::mutex> g(mu_);
  connected_ = false;
  if (rc != 0) log::warning("disconnect", std::string("lost the broker (") + mosquitto_strerror(rc) + "); reconnecting");
}

void Mqtt::on_publish(int mid, int reason) {
  std::lock_guard<std::mutex> g(mu_);
  if (unwaited_.erase(mid)) return;
  acks_[mid] = reason;
  cv_.notify_all();
}

void Mqtt::on_message(const void* m, const void* p) {
  const auto* msg = static_cast<const mosquitto_message*>(m);
  Message out;
  out.topic = msg->topic;
  out.retain = msg->retain;
  const auto* data = static_cast<const uint8_t*>(msg->payload);
  out.payload.assign(data, data + msg->payloadlen);
  const auto* q = static_cast<const mosquitto_property*>(p);
  for (bool first = true; q; first = false) {
    char *k = nullptr, *v = nullptr;
    q = mosquitto_property_read_string_pair(q, MQTT_PROP_USER_PROPERTY, &k, &v, !first);
    if (!q) break;
    out.properties[k] = v;
    free(k);
    free(v);
  }
  received_ += packet_bytes(out.topic, out.payload.size(), v5_, props_len(out.properties));
  unwrap(out.payload, out.properties);
  std::lock_guard<std::mutex> g(mu_);
  if (inbox_.size() >= kInboxMax || inbox_bytes_ + out.payload.size() > kInboxMaxBytes) {
    log::warning("inbox", "inbox full: a message on " + out.topic + " was dropped");
    return;
  }
  inbox_bytes_ += out.payload.size();
  inbox_.push_back(std::move(out));
  cv_.notify_all();
}

void Mqtt::subscribe(const std::string& filter) {
  {
    std::lock_guard<std::mutex> g(mu_);
    subs_.insert(filter);
  }
  const int rc = mosquitto_subscribe_v5(m_, nullptr, filter.c_str(), 1, 0, nullptr);
  if (rc != MOSQ_ERR_SUCCESS) log::warning("subscribe", "subscribe " + filter + " deferred: " + mosquitto_strerror(rc));
}

void Mqtt::set_birth(const std::string& topic, const std::string& payload) {
  {
    std::lock_guard<std::mutex> g(mu_);
    birth_topic_ = topic, birth_payload_ = payload;
  }
  publish(topic, payload, true);
}

int Mqtt::publish_one(const std::string& topic, const std::vector<uint8_t>& payload, bool retain, const Properties& props) {
  int mid = 0;
  mosquitto_property* list = nullptr;
  const std::vector<uint8_t>* body = &payload;
  std::vector<uint8_t> wrapped;
  if (!props.empty()) {
    if (v5_) {
      for (const auto& [k, v] : props) mosquitto_property_add_string_pair(&list, MQTT_PROP_USER_PROPERTY, k.c_str(), v.c_str());
    } else {
      wrapped = wrap(payload, props);
      body = &wrapped;
    }
  }
  const int rc = mosquitto_publish_v5(m_, &mid, topic.c_str(), static_cast<int>(body->size()), body->data(), 1, retain, list);
  mosquitto_property_free_all(&list);
  if (rc != MOSQ_ERR_SUCCESS) throw PublishError("publish on " + topic + " failed: " + mosquitto_strerror(rc));
  sent_ += packet_bytes(topic, body->size(), v5_, v5_ ? props_len(props) : 0);
  return mid;
}

void Mqtt::wait(const std::set<int>& mids, double timeout_s) {
  std::unique_lock<std::mutex> g(mu_);
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  std::string failed;
  for (int mid : mids) {
    if (failed.empty() && !cv_.wait_until(g, end, [&] { return acks_.count(mid) > 0; }))
      failed = "no PUBACK within " + std::to_string(static_cast<int>(timeout_s)) + " s";
    auto it = acks_.find(mid);
    if (it == acks_.end()) {  // never waited for again: its late PUBACK is dropped
      unwaited_.insert(mid);
      continue;
    }
    if (failed.empty() && it->second >= 128)
      failed = std::string("the broker refused a publish: ") + mosquitto_reason_string(it->second);
    acks_.erase(it);
  }
  if (!failed.empty()) throw PublishError(failed);
}

void Mqtt::publish(const std::string& topic, const std::vector<uint8_t>& payload, bool retain, const Properties& props,
                   double timeout_s) {
  wait({publish_one(topic, payload, retain, props)}, timeout_s);
}

void Mqtt::publish_all(const std::string& topic, const std::vector<std::vector<uint8_t>>& payloads,
                       const Properties& props, double timeout_s) {
  std::set<int> mids;
  for (const auto& p : payloads) mids.insert(publish_one(topic, p, false, props));
  wait(mids, timeout_s);
}

std::optional<Message> Mqtt::get(double timeout_s) {
  std::unique_lock<std::mutex> g(mu_);
  if (!cv_.wait_for(g, std::chrono::duration<double>(timeout_s), [&] { return !inbox_.empty(); })) return std::nullopt;
  Message m = std::move(inbox_.front());
  inbox_.pop_front();
  inbox_bytes_ -= m.payload.size();
  return m;
}

}  // namespace fedmoe
