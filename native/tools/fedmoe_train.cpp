// fedmoe-train: runs a sub-MoE training program on files, for tests and benchmarks of the
// native device's training core (the MQTT device that embeds it is not built yet).
//
//   fedmoe-train --program P.pte --manifest M.json --frozen F.safetensors --state S.safetensors
//                --batches B.safetensors --steps K --lr LR [--weight-decay WD] --out OUT.safetensors
//
// or, as a device holds its weights, instead of --frozen: --shards DIR (the base shards as
// DIR/<shard id>.safetensors), --held '{"1": [1, 3]}' (global expert ids per MoE layer) and
// --lora-a A.safetensors (the frozen LoRA A factors, keys with experts by slot); the manifest's
// sources say which stored tensor each frozen input is.
//
// B holds input_ids and attention_mask (K, batch, seq) and labels (K, batch[, seq]); step i
// trains on slice i. Writes the trained adapter state to OUT and prints one JSON line:
// {"losses": [...], "step_s": [...], "rss_before_model_bytes": n, "peak_rss_bytes": n, "rss_bytes": {...}}, the last
// the resident set after each phase: "program" (loaded, with its memory plan), "weights" (base weights and LoRA A
// read and bound), "state" (adapter state put in), "step" (after each step).
// Exit status 2 on bad input (the reason on stderr), 1 on a failed step.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <string>

#include "safetensors.hpp"
#include "trainer.hpp"

namespace {

long rss_bytes() {  // resident set now (/proc/self/statm)
  long pages = 0, resident = 0;
  if (FILE* f = std::fopen("/proc/self/statm", "r")) {
    if (std::fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = 0;
    std::fclose(f);
  }
  return resident * 4096L;
}

// Peak resident set of this program: VmHWM of /proc/self/status (getrusage's ru_maxrss
// would carry a larger parent's peak over fork and exec).
long peak_rss_bytes() {
  long kib = 0;
  if (FILE* f = std::fopen("/proc/self/status", "r")) {
    char line[256];
    while (std::fgets(line, sizeof line, f))
      if (std::sscanf(line, "VmHWM: %ld kB", &kib) == 1) break;
    std::fclose(f);
  }
  return kib * 1024L;
}

fedmoe::TensorView slice(const fedmoe::TensorView& t, int64_t i) {
  fedmoe::TensorView s{t.dtype, {t.shape.begin() + 1, t.shape.end()}, nullptr, t.nbytes / static_cast<size_t>(t.shape.at(0))};
  s.data = t.data + static_cast<size_t>(i) * s.nbytes;
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  const long rss0 = rss_bytes();
  std::map<std::string, std::string> a;
  for (int i = 1; i + 1 < argc; i += 2) a[argv[i]] = argv[i + 1];
  for (const char* k : {"--program", "--manifest", "--state", "--batches", "--steps", "--lr", "--out"})
    if (!a.count(k)) {
      std::cerr << "fedmoe-train: missing " << k << " (see the header of native/tools/fedmoe_train.cpp)\n";
      return 2;
    }
  std::unique_ptr<fedmoe::Trainer> trainer;
  std::unique_ptr<fedmoe::SafetensorsFile> frozen, batches, lora_a;
  std::map<std::string, fedmoe::SafetensorsFile> shards;
  int steps = 0;
  fedmoe::AdamW opt;
  nlohmann::json phases = {{"step", nlohmann::json::array()}};
  try {
    std::ifstream mf(a["--manifest"]);
    if (!mf) throw std::runtime_error(a["--manifest"] + ": cannot open");
    const auto manifest = nlohmann::json::parse(mf);
    steps = std::stoi(a["--steps"]);
    opt.lr = std::stof(a["--lr"]);
    if (a.count("--weight-decay")) opt.weight_decay = std::stof(a["--weight-decay"]);
    trainer = std::make_unique<fedmoe::Trainer>(a["--program"], manifest);
    phases["program"] = rss_bytes();
    if (a.count("--frozen")) {
      frozen = std::make_unique<fedmoe::SafetensorsFile>(a["--frozen"]);
      trainer->bind_frozen(*frozen);
    } else {
      if (!a.count("--shards") || !a.count("--held") || !a.count("--lora-a"))
        throw std::runtime_error("--frozen, or --shards, --held and --lora-a, are needed");
      std::map<int, std::vector<int>> held;
      const auto held_json = nlohmann::json::parse(a["--held"]);  // kept alive: items() refers to it
      if (!held_json.is_object()) throw std::runtime_error("--held is not a JSON object {layer: [ids]}");
      for (const auto& [layer, ids] : held_json.items()) {
        auto& h = held[std::stoi(layer)] = ids.get<std::vector<int>>();
        std::sort(h.begin(), h.end());  // slot j = the j-th smallest held id
        for (int e : h) {
          const auto sid = "L" + layer + ".E" + std::to_string(e);
          shards.emplace(sid, fedmoe::SafetensorsFile(a["--shards"] + "/" + sid + ".safetensors"));
        }
      }
      shards.emplace("backbone", fedmoe::SafetensorsFile(a["--shards"] + "/backbone.safetensors"));
      lora_a = std::make_unique<fedmoe::SafetensorsFile>(a["--lora-a"]);
      trainer->bind_frozen(shards, held, *lora_a);
    }
    phases["weights"] = rss_bytes();
    trainer->load_state(fedmoe::SafetensorsFile(a["--state"]));
    phases["state"] = rss_bytes();
    batches = std::make_unique<fedmoe::SafetensorsFile>(a["--batches"]);
    if (batches->at("input_ids").shape.at(0) < steps) throw std::runtime_error("fewer batches than --steps");
  } catch (const std::exception& e) {
    std::cerr << "fedmoe-train: " << e.what() << "\n";
    return 2;
  }
  nlohmann::json out = {{"losses", nlohmann::json::array()}, {"step_s", nlohmann::json::array()}};
  try {
    for (int i = 0; i < steps; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      const float loss = trainer->step({slice(batches->at("input_ids"), i), slice(batches->at("attention_mask"), i),
                                        slice(batches->at("labels"), i)}, opt);
      out["losses"].push_back(loss);
      out["step_s"].push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      phases["step"].push_back(rss_bytes());
    }
    fedmoe::write_safetensors(a["--out"], trainer->state());
  } catch (const std::exception& e) {
    std::cerr << "fedmoe-train: " << e.what() << "\n";
    return 1;
  }
  out["rss_before_model_bytes"] = rss0;
  out["peak_rss_bytes"] = peak_rss_bytes();
  out["rss_bytes"] = phases;
  std::cout << out.dump() << std::endl;
  return 0;
}
