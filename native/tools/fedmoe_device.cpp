// fedmoe-device: the native (phone-class) device as a command. It joins a federation over
// MQTT and trains with the training programs the aggregator serves (PROTOCOL.md; the
// aggregator needs shard_url and shard_dir). Its data are token ids, written from a CSV or
// JSONL file by `fedmoe data tokens` (tokenising stays with the application).
//
//   fedmoe-device --broker mqtt://HOST:1883 --federation F --task T --budget 512MiB \
//                 --data dev-7.tokens.safetensors --cache DIR \
//                 (--credentials secrets/devices/dev-7.json | --device-id dev-7)
//                 [--formats int8,nf4] [--seed 0] [--val-fraction 0.2] [--tls-ca CA] [--tls-cert C --tls-key K]
//                 [--protocol 5|3.1.1] [--max-payload BYTES] [--rounds N] [--idle-timeout S]
//                 [--hello-timeout S] [--on-no-aggregator exit|wait] [--threads 1] [--verbose]
//
// --threads 1 trains on one thread (ExecuTorch's threadpool off); by default its kernels use
// every core.
//
// Exit status: 0 when the cloud said stop (or --rounds/--idle-timeout ended it), 2 for bad
// arguments or data (the reason on stderr), 3 when no aggregator answered the hello, 1 when
// the broker could not be reached. SIGINT/SIGTERM end it after the current training step.
#include <csignal>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <string>

#include <nlohmann/json.hpp>

#include "device.hpp"
#include "log.hpp"

namespace {

fedmoe::Device* running = nullptr;

void on_signal(int) {
  if (running) running->stop();
}

uint64_t parse_size(const std::string& text) {
  static const std::map<std::string, double> units = {{"", 1}, {"B", 1}, {"KiB", 1024.0}, {"MiB", 1048576.0},
                                                      {"GiB", 1073741824.0}, {"KB", 1e3}, {"MB", 1e6}, {"GB", 1e9}};
  size_t end = 0;
  const double v = std::stod(text, &end);
  const auto unit = units.find(text.substr(end));
  if (unit == units.end() || !(v > 0)) throw std::invalid_argument("bad size " + text + " (e.g. 512MiB, 1.5GiB)");
  return static_cast<uint64_t>(v * unit->second);
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  size_t i = 0;
  while (i <= s.size()) {
    const size_t j = s.find(',', i);
    out.push_back(s.substr(i, j == std::string::npos ? std::string::npos : j - i));
    if (j == std::string::npos) break;
    i = j + 1;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::map<std::string, std::string> a;
  bool verbose = false;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (k == "--verbose") {
      verbose = true;
    } else if (k.rfind("--", 0) == 0 && i + 1 < argc) {
      a[k] = argv[++i];
    } else {
      std::cerr << "fedmoe-device: unexpected argument " << k << " (see native/tools/fedmoe_device.cpp)\n";
      return 2;
    }
  }
  fedmoe::log::set_level(verbose ? fedmoe::log::Level::debug : fedmoe::log::Level::info);
  fedmoe::DeviceConfig cfg;
  try {
    for (const char* k : {"--broker", "--federation", "--task", "--budget", "--data", "--cache"})
      if (!a.count(k)) throw std::invalid_argument(std::string("missing ") + k);
    if (a.count("--credentials")) {
      std::ifstream f(a["--credentials"]);
      if (!f) throw std::invalid_argument(a["--credentials"] + ": cannot open");
      const auto c = nlohmann::json::parse(f);
      cfg.device_id = c.value("device_id", c.value("username", ""));
      cfg.mqtt.username = c.value("username", "");
      cfg.mqtt.password = c.value("password", "");
      cfg.signing_key = c.value("signing_key", "");
    }
    if (a.count("--device-id")) cfg.device_id = a["--device-id"];
    if (cfg.device_id.empty()) throw std::invalid_argument("--device-id or --credentials is needed");
    cfg.federation = a["--federation"];
    cfg.task = a["--task"];
    cfg.budget_bytes = parse_size(a["--budget"]);
    cfg.data_path = a["--data"];
    cfg.cache_dir = a["--cache"];
    if (a.count("--formats")) cfg.weight_formats = split(a["--formats"]);
    if (a.count("--seed")) cfg.seed = std::stoull(a["--seed"]);
    if (a.count("--val-fraction")) cfg.val_fraction = std::stod(a["--val-fraction"]);
    if (a.count("--rounds")) cfg.max_rounds = std::stoi(a["--rounds"]);
    if (a.count("--threads")) {
      if (a["--threads"] != "1") throw std::invalid_argument("--threads: only 1 (or leave it out: every core)");
      cfg.single_thread = true;
    }
    if (a.count("--idle-timeout")) cfg.idle_timeout_s = std::stod(a["--idle-timeout"]);
    if (a.count("--hello-timeout")) cfg.hello_timeout_s = std::stod(a["--hello-timeout"]);
    if (a.count("--on-no-aggregator")) {
      if (a["--on-no-aggregator"] != "exit" && a["--on-no-aggregator"] != "wait")
        throw std::invalid_argument("--on-no-aggregator: exit or wait");
      cfg.exit_when_no_aggregator = a["--on-no-aggregator"] == "exit";
    }
    cfg.mqtt.url = a["--broker"];
    if (a.count("--tls-ca")) cfg.mqtt.tls_ca = a["--tls-ca"];
    if (a.count("--tls-cert")) cfg.mqtt.tls_cert = a["--tls-cert"];
    if (a.count("--tls-key")) cfg.mqtt.tls_key = a["--tls-key"];
    if (a.count("--protocol")) cfg.mqtt.protocol = a["--protocol"];
    if (a.count("--max-payload")) cfg.mqtt.max_payload = parse_size(a["--max-payload"]);
    for (const auto& f : cfg.weight_formats)
      if (f != "fp32" && f != "int8" && f != "nf4") throw std::invalid_argument("--formats: fp32, int8, nf4");
  } catch (const std::exception& e) {
    std::cerr << "fedmoe-device: " << e.what() << "\n";
    return 2;
  }
  std::unique_ptr<fedmoe::Device> device;
  try {
    device = std::make_unique<fedmoe::Device>(cfg);
  } catch (const std::exception& e) {
    std::cerr << "fedmoe-device: " << e.what() << "\n";
    return 2;
  }
  running = device.get();
  std::signal(SIGINT, on_signal);
  std::signal(SIGTERM, on_signal);
  try {
    const int status = device->run();
    running = nullptr;
    return status;
  } catch (const std::exception& e) {
    running = nullptr;
    std::cerr << "fedmoe-device: " << e.what() << "\n";
    return 1;
  }
}
