#include "messages.hpp"

#include <cctype>
#include <cmath>

namespace fedmoe {

namespace {

using json = nlohmann::json;
constexpr int64_t kMaxInt = int64_t{1} << 62;

const json& member(const json& j, const char* key, const std::string& where) {
  if (!j.contains(key)) throw MessageError(where + ": member " + key + " missing");
  return j.at(key);
}

uint64_t as_int(const json& v, const std::string& what, int64_t lo = 0, int64_t hi = kMaxInt) {
  if (!v.is_number_integer()) throw MessageError(what + " must be a JSON integer");
  const int64_t x = v.is_number_unsigned() ? static_cast<int64_t>(std::min<uint64_t>(v.get<uint64_t>(), kMaxInt + 1))
                                           : v.get<int64_t>();
  if (x < lo || x > hi) throw MessageError(what + " out of range");
  return static_cast<uint64_t>(x);
}

double as_num(const json& v, const std::string& what) {
  if (!v.is_number() || v.is_boolean()) throw MessageError(what + " must be a number");
  const double x = v.get<double>();
  if (!std::isfinite(x)) throw MessageError(what + " must be finite");
  return x;
}

std::string as_str(const json& v, const std::string& what, size_t most = 65535) {
  if (!v.is_string()) throw MessageError(what + " must be a string");
  auto s = v.get<std::string>();
  if (s.size() > most) throw MessageError(what + " too long");
  return s;
}

bool as_bool(const json& v, const std::string& what) {
  if (!v.is_boolean()) throw MessageError(what + " must be true or false");
  return v.get<bool>();
}

bool is_url(const std::string& s) {
  if (s.size() > 2048 || !(s.rfind("http://", 0) == 0 || s.rfind("https://", 0) == 0)) return false;
  for (char c : s)
    if (std::isspace(static_cast<unsigned char>(c))) return false;
  return true;
}

json parse(const std::vector<uint8_t>& payload, const std::string& type) {
  if (payload.size() > kMaxControlBytes) throw MessageError(type + " larger than 4 MiB");
  json j;
  try {
    j = json::parse(payload.begin(), payload.end());
  } catch (const json::exception&) {
    throw MessageError(type + " is not JSON");
  }
  if (!j.is_object()) throw MessageError(type + " is not a JSON object");
  if (as_int(member(j, "v", type), type + ".v", 0, 10000) != 1) throw MessageError(type + ": protocol major version is not 1");
  if (as_str(member(j, "type", type), type + ".type") != type) throw MessageError("message type is not " + type);
  return j;
}

FileRef file_ref(const json& j, const std::string& what) {
  if (!j.is_object()) throw MessageError(what + " is not an object");
  FileRef f{as_str(member(j, "url", what), what + ".url"), as_str(member(j, "sha256", what), what + ".sha256"),
            as_int(member(j, "bytes", what), what + ".bytes")};
  if (!is_url(f.url) || !is_hex64(f.sha256)) throw MessageError(what + ": url or sha256 malformed");
  return f;
}

BlobRef blob_ref(const json& j, const std::string& what) {
  if (!j.is_object()) throw MessageError(what + " is not an object");
  BlobRef b{as_str(member(j, "transfer_id", what), what + ".transfer_id"), as_str(member(j, "sha256", what), what + ".sha256"),
            as_int(member(j, "bytes", what), what + ".bytes"), as_int(member(j, "chunks", what), what + ".chunks", 1, 1000000)};
  if (!is_id(b.transfer_id) || !is_hex64(b.sha256)) throw MessageError(what + ": transfer id or sha256 malformed");
  return b;
}

const std::vector<std::string> kFormats = {"fp32", "fp16", "bf16", "int8", "nf4"};

std::string format(const json& v, const std::string& what) {
  auto s = as_str(v, what);
  if (std::find(kFormats.begin(), kFormats.end(), s) == kFormats.end()) throw MessageError(what + " is not a weight format");
  return s;
}

}  // namespace

bool is_hex64(const std::string& s) {
  if (s.size() != 64) return false;
  for (char c : s)
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  return true;
}

bool is_id(const std::string& s) {
  if (s.empty() || s.size() > 64) return false;
  for (char c : s)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.' || c == '-')) return false;
  return true;
}

Assignment parse_assignment(const std::vector<uint8_t>& payload) {
  const json j = parse(payload, "assignment");
  const std::string w = "assignment";
  Assignment a;
  a.round = as_int(member(j, "round", w), "round");
  a.model_version = as_int(member(j, "model_version", w), "model_version");
  if (j.contains("attempt")) a.attempt = as_int(j["attempt"], "attempt");
  a.task = as_str(member(j, "task", w), "task");
  if (!is_id(a.task)) throw MessageError("task is not an id");
  a.weight_format = format(member(j, "weight_format", w), "weight_format");
  a.deadline = as_num(member(j, "deadline", w), "deadline");
  const json& model = member(j, "model", w);
  if (!model.is_object()) throw MessageError("model is not an object");
  a.num_experts = static_cast<int>(model.contains("num_experts") ? as_int(model["num_experts"], "model.num_experts", 1, 1024) : 8);
  a.top_k = static_cast<int>(model.contains("top_k") ? as_int(model["top_k"], "model.top_k", 1, 64) : 2);
  a.max_seq_len = static_cast<int>(model.contains("max_seq_len") ? as_int(model["max_seq_len"], "model.max_seq_len", 8, 4096) : 128);
  a.objective = model.contains("objective") ? as_str(model["objective"], "model.objective") : "classification";
  if (a.objective != "classification" && a.objective != "causal-lm") throw MessageError("model.objective unknown");
  a.model_lora_rank = 8;
  if (model.contains("lora")) {
    const json& l = model["lora"];
    if (!l.is_object()) throw MessageError("model.lora is not an object");
    if (l.contains("rank")) a.model_lora_rank = static_cast<int>(as_int(l["rank"], "model.lora.rank", 1, 256));
  }
  const json& labels = member(j, "labels", w);
  if (!labels.is_array() || labels.size() < 2 || labels.size() > 100000) throw MessageError("labels: 2..100000 strings");
  for (const auto& l : labels) a.labels.push_back(as_str(l, "label"));
  const json& ex = member(j, "experts", w);
  if (!ex.is_object() || ex.empty() || ex.size() > 4096) throw MessageError("experts: 1..4096 layers");
  for (const auto& [key, ids] : ex.items()) {
    if (key.empty() || key.size() > 9 || key.find_first_not_of("0123456789") != std::string::npos)
      throw MessageError("experts key " + key + " is not a layer index");
    const int layer = std::stoi(key);
    if (layer > 65535 || a.experts.count(layer)) throw MessageError("experts layer " + key + " out of range or repeated");
    if (!ids.is_array() || ids.empty() || ids.size() > 1024) throw MessageError("experts of layer " + key + ": 1..1024 ids");
    auto& v = a.experts[layer];
    for (const auto& e : ids) v.push_back(static_cast<int>(as_int(e, "expert id", 0, a.num_experts - 1)));
    std::sort(v.begin(), v.end());
    if (std::adjacent_find(v.begin(), v.end()) != v.end()) throw MessageError("experts of layer " + key + " repeat");
  }
  const json& shards = member(j, "shards", w);
  if (!shards.is_array()) throw MessageError("shards is not an array");
  for (const auto& s : shards) {
    if (!s.is_object()) throw MessageError("a shard manifest is not an object");
    ShardRef r;
    r.shard_id = as_str(member(s, "shard_id", "shard"), "shard_id", 64);
    r.sha256 = as_str(member(s, "sha256", "shard"), "shard sha256");
    r.bytes = as_int(member(s, "bytes", "shard"), "shard bytes");
    r.format = format(member(s, "format", "shard"), "shard format");
    if (!is_hex64(r.sha256)) throw MessageError("shard sha256 malformed");
    if (s.contains("url") && !s["url"].is_null()) {
      r.url = as_str(s["url"], "shard url");
      if (!is_url(*r.url)) throw MessageError("shard url malformed");
    }
    a.shards.push_back(r);
  }
  a.state = blob_ref(member(j, "state", w), "state");
  const json& t = member(j, "train", w);
  if (!t.is_object()) throw MessageError("train is not an object");
  if (t.contains("local_epochs")) a.train.local_epochs = as_num(t["local_epochs"], "train.local_epochs");
  if (!(a.train.local_epochs > 0 && a.train.local_epochs <= 100)) throw MessageError("train.local_epochs out of (0, 100]");
  if (t.contains("max_steps") && !t["max_steps"].is_null()) a.train.max_steps = as_int(t["max_steps"], "train.max_steps", 1);
  if (t.contains("batch_size")) a.train.batch_size = as_int(t["batch_size"], "train.batch_size", 1, 4096);
  if (t.contains("lr")) a.train.lr = as_num(t["lr"], "train.lr");
  if (!(a.train.lr > 0 && a.train.lr <= 10)) throw MessageError("train.lr out of (0, 10]");
  if (t.contains("weight_decay")) a.train.weight_decay = as_num(t["weight_decay"], "train.weight_decay");
  if (t.contains("prox_mu")) a.train.prox_mu = as_num(t["prox_mu"], "train.prox_mu");
  if (a.train.weight_decay < 0 || a.train.prox_mu < 0) throw MessageError("train.weight_decay and prox_mu must be >= 0");
  if (t.contains("collect_hidden")) a.train.collect_hidden = as_bool(t["collect_hidden"], "train.collect_hidden");
  if (t.contains("router")) a.train.router = as_str(t["router"], "train.router");
  if (a.train.router != "aggregated" && a.train.router != "private") throw MessageError("train.router unknown");
  if (j.contains("objectives")) {
    if (!j["objectives"].is_array() || j["objectives"].size() > 16) throw MessageError("objectives: at most 16");
    for (const auto& o : j["objectives"]) {
      if (!o.is_object()) throw MessageError("an objective is not an object");
      a.objectives.push_back(as_str(member(o, "name", "objective"), "objective name", 32));
    }
  }
  if (j.contains("tensors")) {
    if (!j["tensors"].is_object()) throw MessageError("tensors is not an object");
    a.extra_tensors = j["tensors"].size();
  }
  if (j.contains("compressed_updates")) a.compressed_updates = as_bool(j["compressed_updates"], "compressed_updates");
  if (j.contains("uplink") && !j["uplink"].is_null()) {
    a.uplink = as_str(j["uplink"], "uplink");
    if (!is_id(*a.uplink)) throw MessageError("uplink is not an id");
  }
  if (j.contains("program") && !j["program"].is_null()) {
    const json& p = j["program"];
    if (!p.is_object()) throw MessageError("program is not an object");
    ProgramRef r;
    r.runtime = as_str(member(p, "runtime", "program"), "program.runtime", 32);
    r.key = as_str(member(p, "key", "program"), "program.key");
    if (!is_hex64(r.key)) throw MessageError("program.key malformed");
    r.program = file_ref(member(p, "program", "program"), "program.program");
    r.manifest = file_ref(member(p, "manifest", "program"), "program.manifest");
    if (p.contains("lora_a") && !p["lora_a"].is_null()) r.lora_a = file_ref(p["lora_a"], "program.lora_a");
    a.program = r;
  }
  if (j.contains("lora_rank") && !j["lora_rank"].is_null())
    a.lora_rank = static_cast<int>(as_int(j["lora_rank"], "lora_rank", 1, a.model_lora_rank));
  return a;
}

Command parse_command(const std::vector<uint8_t>& payload) {
  const json j = parse(payload, "command");
  Command c;
  c.command = as_str(member(j, "command", "command"), "command", 32);
  if (j.contains("round") && !j["round"].is_null()) c.round = as_int(j["round"], "command.round");
  if (j.contains("reason") && !j["reason"].is_null()) c.reason = as_str(j["reason"], "command.reason", 2000);
  if (j.contains("kind") && !j["kind"].is_null()) c.kind = as_str(j["kind"], "command.kind", 32);
  if (j.contains("upload_id") && !j["upload_id"].is_null()) c.upload_id = as_str(j["upload_id"], "command.upload_id", 64);
  return c;
}

std::string status_json(const std::string& device_id, bool online) {
  nlohmann::ordered_json j = {{"v", 1}, {"type", "status"}, {"device_id", device_id}, {"state", online ? "online" : "offline"}};
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

std::string hello_json(const std::string& device_id, uint64_t budget_bytes, const std::vector<std::string>& formats,
                       uint64_t num_samples, const std::string& task, uint64_t runtime_bytes) {
  nlohmann::ordered_json j = {{"v", 1}, {"type", "hello"}, {"device_id", device_id}, {"sdk_version", "native-0.1"},
                              {"protocol_version", 1}, {"protocol_minor", kProtocolMinor}, {"budget_bytes", budget_bytes},
                              {"weight_formats", formats}, {"num_samples", num_samples}, {"task", task},
                              {"runtime_bytes", runtime_bytes}, {"runtimes", {kFedmoeRuntime, kRuntime}}};
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

std::string ack_json(const std::string& device_id, uint64_t round, uint64_t attempt, bool accepted,
                     const std::string& reason, std::optional<uint64_t> budget, std::optional<uint64_t> runtime,
                     std::optional<uint64_t> needed) {
  auto opt = [](std::optional<uint64_t> v) { return v ? nlohmann::ordered_json(*v) : nlohmann::ordered_json(nullptr); };
  nlohmann::ordered_json j = {{"v", 1}, {"type", "ack"}, {"device_id", device_id}, {"round", round},
                              {"accepted", accepted}, {"reason", reason.empty() ? nlohmann::ordered_json(nullptr)
                                                                                 : nlohmann::ordered_json(reason.substr(0, 1000))},
                              {"attempt", attempt}, {"budget_bytes", opt(budget)}, {"runtime_bytes", opt(runtime)},
                              {"needed_bytes", opt(needed)}};
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace fedmoe
