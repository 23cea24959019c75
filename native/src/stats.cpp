#include "stats.hpp"

#include <algorithm>

namespace fedmoe {

RoutingStats::RoutingStats(const std::map<int, std::vector<int>>& held, int num_experts) : num_experts_(num_experts) {
  for (const auto& [layer, ids] : held) {
    Layer& l = layers_[layer];
    const size_t n = ids.size();
    l.ids = ids;
    l.usage.assign(n, 0), l.top1.assign(n, 0), l.samples.assign(n, 0), l.val_usage.assign(n, 0);
    l.route.assign(n, 0), l.margin.assign(n, 0), l.loss.assign(n, 0), l.correct.assign(n, 0);
  }
}

void RoutingStats::add_train(const std::map<int, LayerRouting>& layers, const int64_t* mask, size_t rows, size_t seq,
                             const float* sample_loss, const float* sample_correct) {
  for (auto& [layer, l] : layers_) {
    const LayerRouting& r = layers.at(layer);
    const size_t n = l.ids.size();
    std::vector<double> per_sample(n);
    for (size_t b = 0; b < rows; ++b) {
      std::fill(per_sample.begin(), per_sample.end(), 0.0);
      bool any = false;
      for (size_t t = 0; t < seq; ++t) {
        const size_t i = b * seq + t;
        if (!mask[i]) continue;
        any = true;
        ++l.tokens;
        const int64_t* idx = r.topk + i * r.k;
        const float* w = r.weight + i * r.k;
        const float* p = r.probs + i * r.n;
        double total = 0;
        for (size_t j = 0; j < r.k; ++j) total += w[j];
        for (size_t j = 0; j < r.k; ++j) {
          const auto s = static_cast<size_t>(idx[j]);
          ++l.usage[s];
          per_sample[s] += 1.0;
          l.route[s] += total > 0 ? w[j] / total : w[j];
        }
        double margin = p[0];
        if (r.n > 1) {  // top-2 of the probabilities
          double a = -1, c = -1;
          for (size_t j = 0; j < r.n; ++j) {
            if (p[j] > a) c = a, a = p[j];
            else if (p[j] > c) c = p[j];
          }
          margin = a - c;
        }
        const auto top = static_cast<size_t>(idx[0]);
        ++l.top1[top];
        l.margin[top] += margin;
      }
      if (!any) continue;
      const auto major = static_cast<size_t>(std::max_element(per_sample.begin(), per_sample.end()) - per_sample.begin());
      if (per_sample[major] <= 0) continue;
      ++l.samples[major];
      l.loss[major] += sample_loss[b];
      l.correct[major] += sample_correct[b];
    }
  }
}

void RoutingStats::add_validation(const std::map<int, LayerRouting>& layers, const int64_t* mask, size_t rows,
                                  size_t seq) {
  for (auto& [layer, l] : layers_) {
    const LayerRouting& r = layers.at(layer);
    for (size_t i = 0; i < rows * seq; ++i) {
      if (!mask[i]) continue;
      ++l.val_tokens;
      for (size_t j = 0; j < r.k; ++j) ++l.val_usage[static_cast<size_t>(r.topk[i * r.k + j])];
    }
  }
}

nlohmann::json RoutingStats::layer_stats() const {
  nlohmann::json out = nlohmann::json::array();
  for (const auto& [layer, l] : layers_) {
    const size_t E = static_cast<size_t>(num_experts_);
    std::vector<uint64_t> usage(E, 0), samples(E, 0);
    std::vector<double> act(E, 0), route(E, 0), margin(E, 0);
    nlohmann::json loss = nlohmann::json::array(), acc = nlohmann::json::array();
    for (size_t e = 0; e < E; ++e) loss.push_back(nullptr), acc.push_back(nullptr);
    for (size_t j = 0; j < l.ids.size(); ++j) {
      const auto e = static_cast<size_t>(l.ids[j]);
      usage[e] = l.usage[j];
      samples[e] = l.samples[j];
      act[e] = static_cast<double>(l.val_usage[j]) / static_cast<double>(std::max<uint64_t>(l.val_tokens, 1));
      route[e] = l.route[j] / static_cast<double>(std::max<uint64_t>(l.tokens, 1));
      margin[e] = l.margin[j] / static_cast<double>(std::max<uint64_t>(l.top1[j], 1));
      if (l.samples[j]) {
        loss[e] = l.loss[j] / static_cast<double>(l.samples[j]);
        acc[e] = l.correct[j] / static_cast<double>(l.samples[j]);
      }
    }
    out.push_back({{"layer", layer}, {"tokens", l.tokens}, {"usage", usage}, {"activation_prob", act},
                   {"routing_dist", route}, {"margin", margin}, {"expert_loss", loss}, {"expert_acc", acc},
                   {"expert_samples", samples}, {"hidden_mean", nullptr}});
  }
  return out;
}

}  // namespace fedmoe
