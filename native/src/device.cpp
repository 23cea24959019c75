#include "device.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <stdexcept>

#include "chunks.hpp"
#include "crypto.hpp"
#include "footprint.hpp"
#include "http.hpp"
#include "log.hpp"
#include "messages.hpp"
#include "payload.hpp"
#include "pyrandom.hpp"
#include "safetensors.hpp"
#include "stats.hpp"
#include "trainer.hpp"

#include <executorch/extension/threadpool/threadpool_guard.h>

namespace fedmoe {

namespace {

using json = nlohmann::json;
constexpr uint64_t kMaxStateBytes = 512ull << 20;  // §6.4: the reference device's limit
constexpr uint64_t kMaxShardBytes = 2ull << 30;
constexpr uint64_t kMaxManifestBytes = 16ull << 20;
constexpr int64_t kIgnore = -100;
constexpr size_t kMaxStates = 8;

double now() { return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count(); }

struct StopRound : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// Refusal before acceptance (the ack says why; a memory refusal carries the figures).
struct Refusal : std::runtime_error {
  using std::runtime_error::runtime_error;
};

std::string mib(uint64_t b) { return std::to_string(static_cast<long long>(std::llround(b / 1048576.0))) + " MiB"; }

/// `expert.{l}.{e}.{path}` / `router.{l}.{e}` with `e` mapped by `f(l, e)`; other keys unchanged.
template <class F>
std::string rekey(const std::string& key, F f) {
  auto split = [](const std::string& s, size_t from, size_t* end) {
    const size_t dot = s.find('.', from);
    *end = dot;
    return s.substr(from, dot == std::string::npos ? std::string::npos : dot - from);
  };
  for (const char* group : {"expert.", "router."}) {
    const size_t g = std::strlen(group);
    if (key.compare(0, g, group) != 0) continue;
    size_t e1 = 0, e2 = 0;
    const std::string l = split(key, g, &e1);
    if (e1 == std::string::npos) return key;
    const std::string e = split(key, e1 + 1, &e2);
    const int mapped = f(std::stoi(l), std::stoi(e));
    return std::string(group) + l + "." + std::to_string(mapped) + (e2 == std::string::npos ? "" : key.substr(e2));
  }
  return key;
}

int slot_of(const std::map<int, std::vector<int>>& held, int layer, int id) {
  const auto& ids = held.at(layer);
  const auto it = std::find(ids.begin(), ids.end(), id);
  if (it == ids.end()) throw std::runtime_error("expert " + std::to_string(id) + " of layer " + std::to_string(layer) + " not held");
  return static_cast<int>(it - ids.begin());
}

}  // namespace

struct Device::Data {
  std::unique_ptr<SafetensorsFile> file;
  TensorView ids, mask;
  size_t n = 0, t = 0;
  std::vector<std::string> labels;  // per sample (classification); empty for causal LM
  std::vector<bool> label_is_id;    // the label was a JSON integer: an id, not a class name
  std::vector<size_t> train, val;   // sample indices, in train_val_split's order
};

struct Device::Held {
  std::string program_sha;
  json manifest;
  std::unique_ptr<Trainer> trainer;
  std::map<std::string, SafetensorsFile> shards;  // by shard id
  std::map<std::string, std::string> shard_sha;
  std::unique_ptr<SafetensorsFile> lora_a;
  std::string lora_sha = "-";
  std::unique_ptr<FileCache> cache;
  Reassembler states{kMaxStateBytes};
};

Device::Device(DeviceConfig config) : cfg_(std::move(config)), data_(std::make_unique<Data>()), held_(std::make_unique<Held>()) {
  if (!is_id(cfg_.device_id) || !is_id(cfg_.federation) || !is_id(cfg_.task))
    throw std::runtime_error("device id, federation and task must be ids (1-64 of [A-Za-z0-9_.-])");
  if (cfg_.budget_bytes == 0) throw std::runtime_error("a memory budget is needed (--budget)");
  if (!(cfg_.val_fraction >= 0 && cfg_.val_fraction < 1)) throw std::runtime_error("val fraction must be in [0, 1)");
  if (cfg_.seed >= (1ull << 46)) throw std::runtime_error("seed must be below 2^46 (the round's seed is seed * 100003 + round)");
  auto& d = *data_;
  d.file = std::make_unique<SafetensorsFile>(cfg_.data_path);
  d.ids = d.file->at("input_ids");
  d.mask = d.file->at("attention_mask");
  if (d.ids.dtype != "I64" || d.mask.dtype != "I64" || d.ids.shape.size() != 2 || d.ids.shape != d.mask.shape ||
      d.ids.shape[0] < 1)
    throw std::runtime_error(cfg_.data_path + ": needs input_ids and attention_mask, int64 (N, T), N >= 1");
  d.n = static_cast<size_t>(d.ids.shape[0]);
  d.t = static_cast<size_t>(d.ids.shape[1]);
  if (auto it = d.file->metadata().find("fedmoe.labels"); it != d.file->metadata().end()) {
    const auto j = json::parse(it->second);
    if (!j.is_array() || j.size() != d.n) throw std::runtime_error(cfg_.data_path + ": fedmoe.labels is not one label per sample");
    for (const auto& l : j) {  // strings name classes (or are decimal ids); integers are ids (encode_labels)
      if (!l.is_string() && !l.is_number_unsigned())
        throw std::runtime_error(cfg_.data_path + ": a label is neither a string nor an id");
      d.labels.push_back(l.is_string() ? l.get<std::string>() : std::to_string(l.get<uint64_t>()));
      d.label_is_id.push_back(!l.is_string());
    }
  }
  // edge_sdk.data.train_val_split: shuffle with the seed, the first round(N * fraction) validate
  std::vector<size_t> order(d.n);
  for (size_t i = 0; i < d.n; ++i) order[i] = i;
  PyRandom(cfg_.seed).shuffle(order);
  auto n_val = static_cast<size_t>(std::nearbyint(static_cast<double>(d.n) * cfg_.val_fraction));
  if (d.n >= 2) n_val = std::min(std::max<size_t>(n_val, 1), d.n - 1);
  d.val.assign(order.begin(), order.begin() + static_cast<long>(n_val));
  d.train.assign(order.begin() + static_cast<long>(n_val), order.end());
  held_->cache = std::make_unique<FileCache>(cfg_.cache_dir);
  runtime_bytes_ = footprint_bytes() + cfg_.headroom_bytes;
}

Device::~Device() = default;

std::string Device::topic(const std::string& kind, const std::optional<std::string>& uplink) const {
  return "fl/v1/" + cfg_.federation + "/dev/" + cfg_.device_id + "/up/" + kind + (uplink ? "/" + *uplink : "");
}

void Device::tell(const Assignment& a, const std::string& reason) {
  try {  // a refusal that cannot be sent (the broker is gone) is logged; the device goes on
    ack(a.round, a.attempt, false, reason);
  } catch (const std::exception& e) {
    log::error(cfg_.device_id + ": could not send the refusal of round " + std::to_string(a.round) + ": " + e.what());
  }
}

void Device::ack(uint64_t round, uint64_t attempt, bool accepted, const std::string& reason,
                 std::optional<uint64_t> budget, std::optional<uint64_t> needed) {
  const bool memory = budget.has_value();
  mqtt_->publish(topic("ack"), ack_json(cfg_.device_id, round, attempt, accepted, reason, budget,
                                        memory ? std::optional<uint64_t>(runtime_bytes_) : std::nullopt, needed));
}

int Device::run() {
  if (cfg_.single_thread) executorch::extension::threadpool::NoThreadPoolGuard::set_enabled(true);  // this thread
  const std::string root = "fl/v1/" + cfg_.federation + "/dev/" + cfg_.device_id;
  MqttOptions o = cfg_.mqtt;
  o.client_id = "dev-" + cfg_.device_id;
  if (o.username.empty()) o.username = cfg_.device_id;
  o.will_topic = root + "/up/status";
  o.will_payload = status_json(cfg_.device_id, false);
  mqtt_ = std::make_unique<Mqtt>(o);
  mqtt_->subscribe(root + "/down/#");
  mqtt_->set_birth(root + "/up/status", status_json(cfg_.device_id, true));
  const std::string hello = hello_json(cfg_.device_id, cfg_.budget_bytes, cfg_.weight_formats, data_->n, cfg_.task, runtime_bytes_);
  mqtt_->publish(root + "/up/hello", hello, true);
  log::info(cfg_.device_id + ": joined " + cfg_.federation + " (budget " + mib(cfg_.budget_bytes) + ", runtime " +
            mib(runtime_bytes_) + ", " + std::to_string(data_->n) + " samples)");
  mark_sent_ = mqtt_->bytes_sent(), mark_received_ = mqtt_->bytes_received();
  const auto joined = std::chrono::steady_clock::now();
  auto last_activity = joined;
  double resend_every = 5;
  auto resend_at = joined + std::chrono::duration<double>(resend_every);
  bool told = false;
  int status = 0;
  while (!stop_ && (cfg_.max_rounds <= 0 || static_cast<int>(history_.size()) < cfg_.max_rounds)) {
    std::optional<Message> m;
    if (!pending_.empty()) {
      m = std::move(pending_.front());
      pending_.erase(pending_.begin());
    } else {
      m = mqtt_->get(1.0);
    }
    const auto t = std::chrono::steady_clock::now();
    if (!m) {
      if (!answered_ && !told && t >= resend_at) {
        log::info(cfg_.device_id + ": no answer to the hello; sending it again");
        try {
          mqtt_->publish(root + "/up/hello", hello, true);
        } catch (const PublishError& e) {
          log::warning("hello", cfg_.device_id + ": the hello was not sent again: " + e.what());
        }
        resend_every *= 2;
        resend_at = t + std::chrono::duration<double>(resend_every);
      }
      if (!answered_ && !told && std::chrono::duration<double>(t - joined).count() > cfg_.hello_timeout_s) {
        told = true;
        const std::string why = "no aggregator of federation '" + cfg_.federation + "' answered the hello within " +
                                std::to_string(static_cast<int>(cfg_.hello_timeout_s)) +
                                " s (is the federation name right? does its aggregator run on this broker?)";
        if (cfg_.exit_when_no_aggregator) {
          log::error(cfg_.device_id + ": " + why + "; leaving");
          status = 3;
          break;
        }
        log::warning("no-aggregator", cfg_.device_id + ": " + why + "; waiting");
      }
      if (cfg_.idle_timeout_s > 0 && std::chrono::duration<double>(t - last_activity).count() > cfg_.idle_timeout_s) {
        log::info(cfg_.device_id + ": no assignment for " + std::to_string(static_cast<int>(cfg_.idle_timeout_s)) + " s; leaving");
        break;
      }
      continue;
    }
    last_activity = t;
    handle(*m);
  }
  try {
    mqtt_->publish(root + "/up/status", status_json(cfg_.device_id, false), true, {}, 5);
  } catch (const std::exception& e) {
    log::warning("offline", std::string("could not publish the offline status: ") + e.what());
  }
  mqtt_.reset();
  return status;
}

void Device::handle(const Message& m) {
  const std::string kind = m.topic.substr(m.topic.rfind('/') + 1);
  if (kind == "assignment") {
    answered_ = true;
    serve(m.payload);
  } else if (kind == "state") {
    try {
      if (auto blob = held_->states.add(m.payload)) keep_state(blob->header.id, blob->header.round, std::move(blob->data));
    } catch (const std::exception& e) {
      log::warning("state-chunk", cfg_.device_id + ": a state chunk was refused: " + e.what());
    }
  } else if (kind == "command") {
    Command c;
    try {
      c = parse_command(m.payload);
    } catch (const std::exception& e) {
      log::warning("command", cfg_.device_id + ": a command was refused: " + e.what());
      return;
    }
    answered_ = true;
    if (c.command == "stop") {
      log::info(cfg_.device_id + ": stop command received" + (c.reason.empty() ? "" : " (" + c.reason + ")") + "; leaving");
      stop_ = true;
    } else if (c.command == "registered") {
      log::info(cfg_.device_id + ": registered with the aggregator of " + cfg_.federation);
    } else if (c.command == "reject" || c.command == "excluded" || c.command == "round_failed") {
      log::warning(c.command, cfg_.device_id + ": " + c.command + (c.round ? " (round " + std::to_string(*c.round) + ")" : "") +
                                  ": " + c.reason);
    } else {
      log::debug("ignoring command " + c.command);
    }
  }
}

void Device::keep_state(const std::string& id, uint64_t round, std::vector<uint8_t> data) {
  if (served_any_ && round < last_.first) return;  // of a round already served: nobody will ask for it
  states_[id] = StateBlob{round, std::move(data)};
  state_order_.push_back(id);
  while (states_.size() > kMaxStates && !state_order_.empty()) {
    states_.erase(state_order_.front());
    state_order_.erase(state_order_.begin());
  }
}

void Device::poll_commands() {  // between training steps: a stop must not wait for the round's end (§4.6)
  while (auto m = mqtt_->get(0)) {
    if (m->topic.size() >= 8 && m->topic.compare(m->topic.size() - 8, 8, "/command") == 0)
      handle(*m);
    else
      pending_.push_back(std::move(*m));
  }
}

void Device::serve(const std::vector<uint8_t>& payload) {
  Assignment a;
  try {
    a = parse_assignment(payload);
  } catch (const std::exception& e) {
    log::warning("assignment", cfg_.device_id + ": an assignment was refused: " + e.what());
    return;
  }
  if (served_any_ && std::make_pair(a.round, a.attempt) <= last_) {
    log::info(cfg_.device_id + ": ignoring a stale assignment for round " + std::to_string(a.round));
    states_.erase(a.state.transfer_id);
    return;
  }
  last_ = {a.round, a.attempt};
  served_any_ = true;
  try {
    train_round(a);
  } catch (const Refusal& e) {
    log::warning("refuse", cfg_.device_id + ": refusing round " + std::to_string(a.round) + ": " + e.what());
    tell(a, e.what());
  } catch (const StopRound& e) {
    log::info(cfg_.device_id + ": round " + std::to_string(a.round) + " left unfinished: " + e.what());
    tell(a, std::string("device stopping: ") + e.what());
  } catch (const std::exception& e) {
    log::error(cfg_.device_id + ": round " + std::to_string(a.round) + " failed: " + e.what());
    tell(a, std::string("round failed on device: ") + e.what());
  }
}

std::vector<uint8_t> Device::await_state(const Assignment& a) {
  std::vector<std::string> ids = {a.state.transfer_id};
  while (true) {
    for (const auto& id : ids)
      if (auto it = states_.find(id); it != states_.end()) {
        auto blob = std::move(it->second.data);
        for (const auto& other : ids) states_.erase(other);
        return blob;
      }
    if (stop_) throw StopRound("asked to stop");
    if (now() > a.deadline) throw std::runtime_error("adapter state did not arrive before the round deadline");
    auto m = mqtt_->get(0.5);
    if (!m) continue;
    const std::string kind = m->topic.substr(m->topic.rfind('/') + 1);
    if (kind == "assignment") {  // a re-sent copy names a new state transfer; anything else waits for later
      try {
        const Assignment b = parse_assignment(m->payload);
        if (b.round == a.round && b.attempt == a.attempt) {
          ids.push_back(b.state.transfer_id);
          continue;
        }
      } catch (const std::exception&) {
      }
      pending_.push_back(std::move(*m));
    } else {
      handle(*m);
    }
  }
}

void Device::train_round(const Assignment& a) {
  const double t_start = now();
  PeakMeter meter;
  meter.start();
  auto& h = *held_;
  auto left = [&] { return std::max(1.0, a.deadline - now()); };
  // what this device cannot run (§5.5: objective terms; §6.4b: a program of its runtime)
  if (!a.objectives.empty() || a.train.prox_mu > 0 || a.train.router != "aggregated" || a.extra_tensors)
    throw Refusal("objective terms are not implemented by this device (the training program holds the task loss only)");
  if (a.train.collect_hidden) throw Refusal("collect_hidden is not implemented by this device");
  if (!a.program) throw Refusal("no training program in the assignment (this device trains only with one)");
  const ProgramRef& p = *a.program;
  if (p.runtime != kFedmoeRuntime && p.runtime != kRuntime)
    throw Refusal("program runtime " + p.runtime + " is neither " + kFedmoeRuntime + " nor " + kRuntime);
  if (a.lora_rank && *a.lora_rank != a.model_lora_rank) throw Refusal("a LoRA rank other than the model's");
  if (std::find(cfg_.weight_formats.begin(), cfg_.weight_formats.end(), a.weight_format) == cfg_.weight_formats.end())
    throw Refusal("weight format " + a.weight_format + " is not one this device holds");
  for (const auto& s : a.shards)
    if (!s.url) throw Refusal("shard " + s.shard_id + " has no URL (this device fetches shards over HTTP only)");
  // the manifest (small), its shape against the assignment, the memory plan
  const uint64_t down0 = h.cache->downloaded();
  const auto mpath = h.cache->fetch(p.manifest.url, p.manifest.sha256, p.manifest.bytes, ".json", kMaxManifestBytes, left());
  const auto mbytes = read_file(mpath);
  const json manifest = json::parse(mbytes.begin(), mbytes.end());
  const json& shape = manifest.at("shape");
  json per_layer = json::object();
  for (const auto& [layer, ids] : a.experts) per_layer[std::to_string(layer)] = ids.size();
  const std::string runtime = manifest.value("runtime", "");
  if (runtime != p.runtime || manifest.value("key", "") != p.key ||
      manifest.value("sha256", "") != p.program.sha256 || shape.at("experts_per_layer") != per_layer ||
      shape.at("batch_size").get<uint64_t>() != a.train.batch_size || shape.at("weight_format") != a.weight_format ||
      shape.at("task") != a.task || shape.value("format", 1) < 2 ||
      shape.at("seq_len").get<int64_t>() != a.max_seq_len)
    throw Refusal("the program's manifest is for another shape (experts per layer, batch, weight format or task)");
  const auto T = shape.at("seq_len").get<size_t>();
  const auto B = static_cast<size_t>(a.train.batch_size);
  if (data_->t > T)
    throw Refusal("the data holds " + std::to_string(data_->t) + " tokens per sample, the program " + std::to_string(T) +
                  " (write it again with fedmoe data tokens --max-seq-len " + std::to_string(T) + ")");
  std::map<std::string, uint64_t> unique;
  for (const auto& s : a.shards) unique[s.sha256] = s.bytes;
  uint64_t shard_bytes = 0;
  for (const auto& [_, b] : unique) shard_bytes += b;
  const uint64_t trainable = manifest.value("trainable_bytes", uint64_t{0});
  const uint64_t needed = runtime_bytes_ + shard_bytes + p.program.bytes + manifest.value("planned_bytes", uint64_t{0}) +
                          (p.lora_a ? p.lora_a->bytes : 0) + a.state.bytes + 3 * trainable;
  if (needed > cfg_.budget_bytes) {
    const std::string why = "over budget: the memory plan needs " + mib(needed) + " (" + a.weight_format + "), budget is " +
                            mib(cfg_.budget_bytes);
    log::warning("budget", cfg_.device_id + ": refusing round " + std::to_string(a.round) + ": " + why);
    ack(a.round, a.attempt, false, why, cfg_.budget_bytes, needed);
    return;
  }
  auto state_blob = await_state(a);
  ack(a.round, a.attempt, true);
  // the files, verified; the program loaded once per sha256; shards kept while assigned
  std::vector<std::string> fetched;
  const auto ppath = h.cache->fetch(p.program.url, p.program.sha256, p.program.bytes, ".pte", kMaxShardBytes, left());
  std::map<std::string, std::string> wanted;  // shard id -> sha256
  for (const auto& s : a.shards) wanted[s.shard_id] = s.sha256;
  for (auto it = h.shards.begin(); it != h.shards.end();)
    it = (wanted.count(it->first) && wanted[it->first] == h.shard_sha[it->first]) ? std::next(it) : h.shards.erase(it);
  for (const auto& s : a.shards) {
    if (h.shards.count(s.shard_id)) continue;
    const bool cached = std::filesystem::exists(h.cache->directory() + "/" + s.sha256 + ".safetensors");
    const auto path = h.cache->fetch(*s.url, s.sha256, s.bytes, ".safetensors", kMaxShardBytes, left());
    if (!cached) fetched.push_back(s.shard_id);
    h.shards.emplace(s.shard_id, SafetensorsFile(path));
    h.shard_sha[s.shard_id] = s.sha256;
    meter.mark();
    if (stop_) throw StopRound("asked to stop");
  }
  const std::string lora_sha = p.lora_a ? p.lora_a->sha256 : "";
  if (lora_sha != h.lora_sha) {
    h.lora_a = std::make_unique<SafetensorsFile>(
        p.lora_a ? SafetensorsFile(h.cache->fetch(p.lora_a->url, p.lora_a->sha256, p.lora_a->bytes, ".safetensors",
                                                  kMaxShardBytes, left()))
                 : SafetensorsFile(safetensors_bytes({}), "no LoRA A"));
    h.lora_sha = lora_sha;
  }
  if (h.program_sha != p.program.sha256) {
    h.trainer.reset();
    h.trainer = std::make_unique<Trainer>(ppath, manifest);
    h.program_sha = p.program.sha256;
    h.manifest = manifest;
  }
  Trainer& trainer = *h.trainer;
  trainer.bind_frozen(h.shards, a.experts, *h.lora_a);
  meter.mark();
  // the adapter state: exactly the program's trainable tensors, by global id (§7.2)
  Decoded state = decode_payload(state_blob, kMaxStateBytes);
  if (state.encoding != "state") throw std::runtime_error("the adapter state is delta-encoded (only updates may be)");
  state_blob.clear();
  state_blob.shrink_to_fit();
  std::map<std::string, TensorView> by_slot;
  std::map<std::string, std::string> slot_key;  // global key -> slot key
  for (const auto& [name, key] : manifest.at("trainable").items()) {
    const std::string k = key.get<std::string>();
    slot_key[rekey(k, [&](int l, int j) { return a.experts.at(l).at(static_cast<size_t>(j)); })] = k;
  }
  if (state.tensors.size() != slot_key.size())
    throw std::runtime_error("the adapter state holds " + std::to_string(state.tensors.size()) + " tensors, the program trains " +
                             std::to_string(slot_key.size()));
  for (auto& [key, t] : state.tensors) {
    auto it = slot_key.find(key);
    if (it == slot_key.end()) throw std::runtime_error("the adapter state holds " + key + ", which this device does not train");
    by_slot[it->second] = TensorView{"F32", t.shape, reinterpret_cast<uint8_t*>(t.data.data()), t.data.size() * 4};
  }
  trainer.load_state(by_slot);
  state.tensors.clear();
  // labels by the assignment's list (edge_sdk.data.encode_labels)
  const auto& d = *data_;
  const bool lm = a.objective == "causal-lm";
  std::vector<int64_t> label_of(d.n, 0);
  if (!lm) {
    if (d.labels.empty()) throw std::runtime_error("the data has no labels (fedmoe.labels) for a classification task");
    for (size_t i = 0; i < d.n; ++i) {
      const std::string& y = d.labels[i];
      const auto it = d.label_is_id[i] ? a.labels.end() : std::find(a.labels.begin(), a.labels.end(), y);
      if (d.label_is_id[i] && y.size() < 10 && std::stoull(y) < a.labels.size()) {
        label_of[i] = static_cast<int64_t>(std::stoull(y));
      } else if (it != a.labels.end()) {
        label_of[i] = it - a.labels.begin();
      } else if (!y.empty() && y.size() < 10 && y.find_first_not_of("0123456789") == std::string::npos &&
                 std::stoul(y) < a.labels.size()) {
        label_of[i] = static_cast<int64_t>(std::stoul(y));
      } else {
        throw std::runtime_error("unknown label '" + y + "'");
      }
    }
  }
  // one batch of samples, padded to the program's (B, T) (§6.4b)
  std::vector<int64_t> ids(B * T), mask(B * T), labels(lm ? B * T : B);
  auto fill = [&](const std::vector<size_t>& rows) {
    std::fill(ids.begin(), ids.end(), 0);
    std::fill(mask.begin(), mask.end(), 0);
    std::fill(labels.begin(), labels.end(), lm ? kIgnore : 0);
    const auto* src_ids = reinterpret_cast<const int64_t*>(d.ids.data);
    const auto* src_mask = reinterpret_cast<const int64_t*>(d.mask.data);
    for (size_t r = 0; r < B; ++r) {
      const size_t s = rows[r];
      for (size_t c = 0; c < d.t; ++c) {
        ids[r * T + c] = src_ids[s * d.t + c];
        mask[r * T + c] = src_mask[s * d.t + c];
        if (lm && mask[r * T + c]) labels[r * T + c] = ids[r * T + c];
      }
      if (!lm) labels[r] = label_of[s];
    }
    auto view = [](std::vector<int64_t>& v, std::vector<int64_t> shape) {
      return TensorView{"I64", std::move(shape), reinterpret_cast<uint8_t*>(v.data()), v.size() * 8};
    };
    return std::vector<TensorView>{view(ids, {static_cast<int64_t>(B), static_cast<int64_t>(T)}),
                                   view(mask, {static_cast<int64_t>(B), static_cast<int64_t>(T)}),
                                   lm ? view(labels, {static_cast<int64_t>(B), static_cast<int64_t>(T)})
                                      : view(labels, {static_cast<int64_t>(B)})};
  };
  auto routing = [&]() {
    std::map<int, LayerRouting> out;
    for (const auto& [layer, held] : a.experts) {
      const std::string pre = "router." + std::to_string(layer) + ".";
      const auto probs = trainer.output(pre + "probs"), topk = trainer.output(pre + "topk_idx"),
                 weight = trainer.output(pre + "topk_weight");
      out[layer] = LayerRouting{reinterpret_cast<const float*>(probs.data), reinterpret_cast<const int64_t*>(topk.data),
                                reinterpret_cast<const float*>(weight.data), static_cast<size_t>(probs.shape.at(1)),
                                static_cast<size_t>(topk.shape.at(1))};
    }
    return out;
  };
  // train (moe_model.train.train_local: steps, the seeded order, AdamW fresh each round)
  RoutingStats stats(a.experts, a.num_experts);
  const size_t n_train = d.train.size();
  if (n_train == 0) throw std::runtime_error("no local training samples");
  uint64_t steps = static_cast<uint64_t>(std::ceil(a.train.local_epochs * static_cast<double>(n_train) / static_cast<double>(B)));
  if (a.train.max_steps) steps = std::min(steps, *a.train.max_steps);
  PyRandom rng(cfg_.seed * 100003 + a.round);
  AdamW opt;
  opt.lr = static_cast<float>(a.train.lr);
  opt.weight_decay = static_cast<float>(a.train.weight_decay);
  uint64_t done = 0, seen = 0;
  double loss_sum = 0;
  const double t_train = now();
  auto logged = t_train;
  while (done < steps) {
    std::vector<size_t> order(n_train);
    for (size_t i = 0; i < n_train; ++i) order[i] = i;
    rng.shuffle(order);
    for (size_t at = 0; at < n_train && done < steps; at += B) {
      const size_t real = std::min(B, n_train - at);
      std::vector<size_t> rows;
      for (size_t r = 0; r < B; ++r) rows.push_back(d.train[order[r < real ? at + r : r % n_train]]);  // a short batch: filled again from the start
      const float loss = trainer.step(fill(rows), opt);
      stats.add_train(routing(), mask.data(), B, T, reinterpret_cast<const float*>(trainer.output("sample_loss").data),
                      reinterpret_cast<const float*>(trainer.output("sample_correct").data));
      ++done;
      seen += real;
      loss_sum += static_cast<double>(loss) * static_cast<double>(real);
      meter.mark();
      poll_commands();
      if (now() - logged >= 10 && done < steps) {
        log::info(cfg_.device_id + " round " + std::to_string(a.round) + ": step " + std::to_string(done) + "/" +
                  std::to_string(steps) + ", loss " + std::to_string(loss));
        logged = now();
      }
      if (stop_) throw StopRound("asked to stop");
    }
  }
  const double train_seconds = now() - t_train;
  // validation (moe_model.train.evaluate at the training batch size): loss, accuracy, activation probabilities
  double v_loss = 0, v_correct = 0, v_weight = 0;
  for (size_t at = 0; at < d.val.size(); at += B) {
    const size_t real = std::min(B, d.val.size() - at);
    std::vector<size_t> rows;
    for (size_t r = 0; r < B; ++r) rows.push_back(d.val[r < real ? at + r : at]);
    trainer.evaluate(fill(rows));
    const auto* sl = reinterpret_cast<const float*>(trainer.output("sample_loss").data);
    const auto* sc = reinterpret_cast<const float*>(trainer.output("sample_correct").data);
    for (size_t r = 0; r < real; ++r) {
      double w = 1;
      if (lm) {
        w = 0;
        for (size_t c = 1; c < T; ++c) w += labels[r * T + c] != kIgnore;
      }
      v_loss += sl[r] * w, v_correct += sc[r] * w, v_weight += w;
    }
    stats.add_validation(routing(), mask.data(), real, T);
    meter.mark();
  }
  // the update: the trained state by global id, fp32 (compressed where the cloud reads it), signed chunks
  FloatTensors update;
  for (const auto& [key, t] : trainer.state()) {
    FloatTensor f{t.shape, std::vector<float>(t.nbytes / 4)};
    std::memcpy(f.data.data(), t.data, t.nbytes);
    update.emplace(rekey(key, [&](int l, int j) { return a.experts.at(l).at(static_cast<size_t>(j)); }), std::move(f));
  }
  const auto blob = encode_fp32(update, a.compressed_updates);
  update.clear();
  const std::string upload_id = random_hex(8);
  std::string sha;
  const auto chunks = split_blob(blob, mqtt_->max_payload(), upload_id, "update", a.round, &sha);
  std::unique_ptr<Signer> signer = cfg_.signing_key.empty() ? nullptr : std::make_unique<Signer>(cfg_.signing_key);
  auto props = [&](const std::string& kind, const std::string& digest) {
    Properties out;
    if (!signer) return out;
    out = {{"fm-round", std::to_string(a.round)}, {"fm-upload", upload_id}, {"fm-sha", digest},
           {"fm-sig", signer->sign_b64(signed_text(kind, cfg_.device_id, a.round, upload_id, digest))}};
    return out;
  };
  mqtt_->publish_all(topic("update", a.uplink), chunks, props("update", sha), std::max(120.0, a.deadline - now()));
  meter.stop();
  // the statistics (§5.4); bytes_up counts this very message: iterate to the fixed point
  const uint64_t down = mqtt_->bytes_received() - mark_received_;
  const uint64_t up_before = mqtt_->bytes_sent() - mark_sent_;
  json layers = stats.layer_stats();
  auto build = [&](uint64_t bytes_up) {
    nlohmann::ordered_json j = {
        {"v", 1}, {"type", "stats"}, {"device_id", cfg_.device_id}, {"round", a.round}, {"task", a.task},
        {"num_samples", n_train}, {"train_loss", loss_sum / static_cast<double>(std::max<uint64_t>(seen, 1))},
        {"val_loss", v_weight > 0 ? nlohmann::ordered_json(v_loss / v_weight) : nlohmann::ordered_json(nullptr)},
        {"val_accuracy", v_weight > 0 ? nlohmann::ordered_json(v_correct / v_weight) : nlohmann::ordered_json(nullptr)},
        {"layers", layers},
        {"update", {{"transfer_id", upload_id}, {"bytes", blob.size()}, {"sha256", sha}, {"chunks", chunks.size()}}},
        {"train_seconds", train_seconds}, {"bytes_up", bytes_up}, {"bytes_down", down}, {"payload_up", blob.size()},
        {"payload_down", h.cache->downloaded() - down0 + a.state.bytes}, {"peak_rss_bytes", meter.peak_rss()},
        {"peak_footprint_bytes", meter.peak_footprint()}, {"baseline_rss_bytes", runtime_bytes_},
        {"shards_fetched", fetched}, {"predicted_peak_bytes", needed}, {"weight_format", a.weight_format},
        {"extras", json::object()}};
    return j.dump(-1, ' ', false, json::error_handler_t::replace);
  };
  const std::string stats_topic = topic("stats", a.uplink);
  uint64_t up = up_before;
  std::string payload = build(up);
  for (int i = 0; i < 8; ++i) {
    const auto digest = sha256_hex(payload);
    const auto p_len = signer ? [&] {
      size_t n = 0;
      for (const auto& [k, v] : props("stats", digest)) n += 5 + k.size() + v.size();
      return n;
    }() : 0;
    const uint64_t total = up_before + Mqtt::packet_bytes(stats_topic, payload.size(), mqtt_->v5(), mqtt_->v5() ? p_len : 0);
    if (total == up) break;
    up = total;
    payload = build(up);
  }
  mqtt_->publish(stats_topic, payload, false, props("stats", sha256_hex(payload)));
  mark_sent_ = mqtt_->bytes_sent(), mark_received_ = mqtt_->bytes_received();
  RoundSummary r{a.round, loss_sum / static_cast<double>(std::max<uint64_t>(seen, 1)),
                 v_weight > 0 ? v_correct / v_weight : -1, now() - t_start, meter.peak_footprint(), needed, up, down, done};
  history_.push_back(r);
  log::info(cfg_.device_id + " round " + std::to_string(a.round) + ": " + std::to_string(done) + " steps, loss " +
            std::to_string(r.train_loss) + ", peak footprint " + mib(r.peak_footprint) + " of a plan of " + mib(needed) +
            " (budget " + mib(cfg_.budget_bytes) + ")");
}

}  // namespace fedmoe
