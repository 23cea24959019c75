// The training core of the native (phone-class) device: runs the sub-MoE training step
// that moe_model/training_program.py exports (an ExecuTorch training program) with
// AdamW outside the program, as the Python device trains (torch.optim.AdamW, fresh each
// round). This is the part an Android (JNI) or iOS (Objective-C++) wrapper calls.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include <executorch/extension/module/module.h>
#include <nlohmann/json.hpp>

#include "safetensors.hpp"

namespace fedmoe {

/// AdamW hyper-parameters (torch.optim.AdamW's defaults but lr and weight decay).
struct AdamW {
  float lr = 1e-3f, weight_decay = 0.01f, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f;
};

/// One training program with its frozen inputs and trainable parameters.
class Trainer {
 public:
  /// Loads the program (`pte_path`) and reads its manifest (TrainingProgram.manifest():
  /// batch inputs, frozen inputs, parameter name -> adapter-state key). Throws
  /// std::runtime_error when the program does not load or the manifest is malformed.
  Trainer(const std::string& pte_path, const nlohmann::json& manifest);
  ~Trainer();

  /// Binds every frozen input (manifest order) to the tensor of the same name in `file`
  /// (no copy: `file` must outlive the Trainer). Throws when one is missing or its dtype
  /// or shape differs from the manifest's.
  void bind_frozen(const SafetensorsFile& file);

  /// Binds every frozen input from where the manifest's `source` says it is (no copy: the
  /// files must outlive the Trainer): a base shard's stored tensor (`shards` by shard id:
  /// "backbone", "L{layer}.E{global id}", where slot j of a layer is `held[layer][j]`, the
  /// j-th smallest held id), or a frozen LoRA A factor (`lora_a`, by the source's key, experts
  /// by slot). Throws when the manifest has no sources, a shard or tensor is missing, or a
  /// dtype or shape differs.
  void bind_frozen(const std::map<std::string, SafetensorsFile>& shards,
                   const std::map<int, std::vector<int>>& held, const SafetensorsFile& lora_a);

  /// Sets the trainable parameters from an adapter state (keys with experts by slot) and
  /// starts a fresh AdamW (as the Python device does each round). Applied before the next
  /// step; throws when a key is missing, not fp32, or its size differs.
  void load_state(const SafetensorsFile& state);
  void load_state(const std::map<std::string, TensorView>& state);

  /// One optimizer step on one batch (`input_ids`, `attention_mask`, `labels` as the
  /// manifest's batch inputs, shapes exact); returns the loss (nats, mean over the
  /// batch). Throws when the program fails or the loss is not finite.
  float step(const std::vector<TensorView>& batch, const AdamW& opt);

  /// The program on one batch without an optimizer step (validation); returns the loss.
  float evaluate(const std::vector<TensorView>& batch);

  /// An output of the last step or evaluation by its manifest name (`outputs`: `logits`,
  /// `sample_loss`, `router.{l}.probs`, ...); valid until the next one. Throws when the
  /// manifest has no such output.
  TensorView output(const std::string& name) const;

  /// The trainable parameters by adapter-state key (fp32, owned by the program).
  std::map<std::string, TensorView> state() const;

  /// Bytes of the memory ExecuTorch planned for the program's intermediate tensors
  /// (manifest `planned_bytes`; 0 when the manifest does not say).
  uint64_t planned_bytes() const;

 private:
  std::vector<executorch::runtime::EValue> run(const std::vector<TensorView>& batch);
  void prepare(const std::vector<TensorView>& batch);
  std::vector<executorch::runtime::EValue> last_;
  std::unique_ptr<executorch::extension::module::Module> module_;
  size_t grad_start_ = 0, param_start_ = 0;
  std::vector<std::string> names_;  // parameter names, in the program's gradient order
  nlohmann::json manifest_;
  std::vector<TensorView> frozen_;
  std::map<std::string, std::vector<float>> pending_;  // state to load, by parameter name
  std::map<std::string, std::vector<int64_t>> pending_shape_;
  std::map<std::string, TensorView> params_;           // by parameter name, once known
  std::map<std::string, std::vector<float>> m_, v_;    // AdamW moments
  int t_ = 0;
};

}  // namespace fedmoe
