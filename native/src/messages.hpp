// The control messages of PROTOCOL.md §5 that the native device sends (Hello, Status, Ack,
// Stats: JSON built here) and receives (Assignment, Command: parsed with the strict types of
// §5.0, every member the device uses checked against its bounds).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace fedmoe {

constexpr int kProtocolMinor = 13;
// Hello.runtimes, preferred first (PROTOCOL.md §6.4b): ExecuTorch 1.5 with the project's operators (kernels.cpp), then
// without them
constexpr const char* kFedmoeRuntime = "executorch-1.5+fedmoe2";
constexpr const char* kRuntime = "executorch-1.5";
constexpr size_t kMaxControlBytes = 4u << 20;  // §5.0

struct FileRef {
  std::string url, sha256;
  uint64_t bytes = 0;
};

struct ShardRef {
  std::string shard_id, sha256, format;
  std::optional<std::string> url;
  uint64_t bytes = 0;
};

struct BlobRef {
  std::string transfer_id, sha256;
  uint64_t bytes = 0, chunks = 1;
};

struct ProgramRef {
  std::string runtime, key;
  FileRef program, manifest;
  std::optional<FileRef> lora_a;
};

struct TrainConfig {
  double local_epochs = 1.0, lr = 1e-3, weight_decay = 0.0, prox_mu = 0.0;
  std::optional<uint64_t> max_steps;
  uint64_t batch_size = 8;
  bool collect_hidden = false;
  std::string router = "aggregated";
};

struct Assignment {
  uint64_t round = 0, attempt = 0, model_version = 0;
  std::string task, weight_format, objective;
  int num_experts = 0, top_k = 0, max_seq_len = 0, model_lora_rank = 0;
  std::vector<std::string> labels;
  std::map<int, std::vector<int>> experts;  // MoE layer -> held global ids, ascending
  std::vector<ShardRef> shards;
  BlobRef state;
  TrainConfig train;
  double deadline = 0;
  std::vector<std::string> objectives;  // term names
  size_t extra_tensors = 0;
  bool compressed_updates = false;
  std::optional<std::string> uplink;
  std::optional<ProgramRef> program;
  std::optional<int> lora_rank;
};

struct Command {
  std::string command, reason, kind, upload_id;
  std::optional<uint64_t> round;
};

/// Thrown for a message that breaks §5 (the reason says which rule).
struct MessageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// Parses an `Assignment` (§5.5); throws MessageError.
Assignment parse_assignment(const std::vector<uint8_t>& payload);
/// Parses a `Command` (§5.6); throws MessageError.
Command parse_command(const std::vector<uint8_t>& payload);

std::string status_json(const std::string& device_id, bool online);
std::string hello_json(const std::string& device_id, uint64_t budget_bytes, const std::vector<std::string>& formats,
                       uint64_t num_samples, const std::string& task, uint64_t runtime_bytes);
/// An `Ack`; `budget`, `runtime` and `needed` (bytes) only for a refusal for memory.
std::string ack_json(const std::string& device_id, uint64_t round, uint64_t attempt, bool accepted,
                     const std::string& reason = "", std::optional<uint64_t> budget = std::nullopt,
                     std::optional<uint64_t> runtime = std::nullopt, std::optional<uint64_t> needed = std::nullopt);

/// True when `s` is an id (1-64 of [A-Za-z0-9_.-]).
bool is_id(const std::string& s);
/// True when `s` is 64 lowercase hex digits (a sha256).
bool is_hex64(const std::string& s);

}  // namespace fedmoe
