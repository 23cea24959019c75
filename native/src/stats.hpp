// The expert-activation statistics a device reports each round (PROTOCOL.md §5.4
// `LayerStats`, as moe_model/stats.py computes them), from what a training program returns
// per MoE layer: routing probabilities (B·T, n), top-k slots (B·T, k) and their gate
// weights (B·T, k), over the n held experts by slot.
#pragma once

#include <cstdint>
#include <map>
#include <vector>

#include <nlohmann/json.hpp>

namespace fedmoe {

/// One MoE layer's routing of one batch (pointers into a program's outputs).
struct LayerRouting {
  const float* probs = nullptr;     // (N, n)
  const int64_t* topk = nullptr;    // (N, k)
  const float* weight = nullptr;    // (N, k)
  size_t n = 0, k = 0;
};

class RoutingStats {
 public:
  /// `held`: MoE layer -> held global expert ids ascending (slot j = held[layer][j]);
  /// `num_experts`: E, the length of every reported list.
  RoutingStats(const std::map<int, std::vector<int>>& held, int num_experts);

  /// One training batch of `rows` samples x `seq` tokens (`mask` (rows, seq), 1 = real
  /// token), with each sample's loss and correctness: usage, routing mass, top-1 margins,
  /// and the loss, accuracy and count of samples by majority expert (FLEX-MoE, FedAlign-MoE,
  /// Fed-MoE; moe_model/stats.py).
  void add_train(const std::map<int, LayerRouting>& layers, const int64_t* mask, size_t rows, size_t seq,
                 const float* sample_loss, const float* sample_correct);
  /// One validation batch: the first `rows` samples count (activation probabilities, FedMoE).
  void add_validation(const std::map<int, LayerRouting>& layers, const int64_t* mask, size_t rows, size_t seq);
  /// `Stats.layers`: one LayerStats object per MoE layer, lists indexed by global expert id.
  nlohmann::json layer_stats() const;

 private:
  struct Layer {
    std::vector<int> ids;
    uint64_t tokens = 0, val_tokens = 0;
    std::vector<uint64_t> usage, top1, samples, val_usage;
    std::vector<double> route, margin, loss, correct;
  };
  std::map<int, Layer> layers_;
  int num_experts_;
};

}  // namespace fedmoe
