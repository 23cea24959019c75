#include "trainer.hpp"

#include <cmath>
#include <cstring>
#include <stdexcept>

#include <executorch/extension/tensor/tensor.h>

#include "kernels.hpp"

namespace fedmoe {

using executorch::aten::ScalarType;
using executorch::extension::from_blob;
using executorch::extension::TensorPtr;
using executorch::extension::module::Module;
using executorch::runtime::EValue;

namespace {

// torch's dtype names (the manifest) -> safetensors' names and ExecuTorch's scalar types
struct DType {
  const char* safetensors;
  ScalarType type;
};
const std::map<std::string, DType>& dtypes() {
  static const std::map<std::string, DType> m = {
      {"float32", {"F32", ScalarType::Float}}, {"int64", {"I64", ScalarType::Long}},
      {"int8", {"I8", ScalarType::Char}},      {"uint8", {"U8", ScalarType::Byte}},
      {"bfloat16", {"BF16", ScalarType::BFloat16}}, {"float16", {"F16", ScalarType::Half}},
      {"int32", {"I32", ScalarType::Int}},     {"bool", {"BOOL", ScalarType::Bool}}};
  return m;
}
const DType& dtype_of(const std::string& torch_name) {
  auto it = dtypes().find(torch_name);
  if (it == dtypes().end()) throw std::runtime_error("unsupported dtype " + torch_name);
  return it->second;
}
ScalarType scalar_type_of(const std::string& safetensors_name) {
  for (const auto& [_, d] : dtypes())
    if (safetensors_name == d.safetensors) return d.type;
  throw std::runtime_error("unsupported dtype " + safetensors_name);
}

int64_t method_int(Module& m, const std::string& name) {
  auto r = m.execute(name);
  if (!r.ok() || r->empty() || !(*r)[0].isInt()) throw std::runtime_error("program lacks method " + name);
  return (*r)[0].toInt();
}

void check_like(const TensorView& t, const nlohmann::json& spec, const std::string& what) {
  const auto& d = dtype_of(spec.at("dtype").get<std::string>());
  if (t.dtype != d.safetensors || t.shape != spec.at("shape").get<std::vector<int64_t>>())
    throw std::runtime_error(what + " " + spec.at("name").get<std::string>() + ": dtype or shape differs from the program's");
}

}  // namespace

Trainer::Trainer(const std::string& pte_path, const nlohmann::json& manifest)
    : module_(std::make_unique<Module>(pte_path, Module::LoadMode::File)), manifest_(manifest) {
  if (!register_kernels()) throw std::runtime_error("the project's ExecuTorch kernels do not register");
  if (module_->load_method("forward") != executorch::runtime::Error::Ok)
    throw std::runtime_error(pte_path + ": the program's forward method does not load");
  grad_start_ = static_cast<size_t>(method_int(*module_, "__et_training_gradients_index_forward"));
  param_start_ = static_cast<size_t>(method_int(*module_, "__et_training_parameters_index_forward"));
  auto fqn = module_->execute("__et_training_fqn_forward");
  if (!fqn.ok()) throw std::runtime_error("program lacks its parameter names");
  for (const auto& e : *fqn) names_.emplace_back(e.toString());
  if (names_.size() != param_start_ - grad_start_) throw std::runtime_error("program's gradient outputs and names disagree");
  for (const auto& n : names_)
    if (!manifest_.at("trainable").contains(n)) throw std::runtime_error("manifest lacks parameter " + n);
}

Trainer::~Trainer() = default;

void Trainer::bind_frozen(const SafetensorsFile& file) {
  frozen_.clear();
  for (const auto& spec : manifest_.at("frozen")) {
    const auto& t = file.at(spec.at("name").get<std::string>());
    check_like(t, spec, "frozen input");
    frozen_.push_back(t);
  }
}

void Trainer::bind_frozen(const std::map<std::string, SafetensorsFile>& shards,
                          const std::map<int, std::vector<int>>& held, const SafetensorsFile& lora_a) {
  frozen_.clear();
  for (const auto& spec : manifest_.at("frozen")) {
    const auto name = spec.at("name").get<std::string>();
    if (!spec.contains("source")) throw std::runtime_error("manifest has no source for frozen input " + name);
    const auto& src = spec.at("source");
    const TensorView* t = nullptr;
    if (src.contains("lora_a")) {
      t = &lora_a.at(src.at("lora_a").get<std::string>());
    } else {
      std::string sid = "backbone";
      if (src.contains("layer")) {
        const auto layer = src.at("layer").get<int>();
        const auto slot = src.at("slot").get<size_t>();
        auto it = held.find(layer);
        if (it == held.end() || slot >= it->second.size())
          throw std::runtime_error("frozen input " + name + ": no held expert in its slot");
        sid = "L" + std::to_string(layer) + ".E" + std::to_string(it->second[slot]);
      } else {
        sid = src.at("shard").get<std::string>();
      }
      auto sh = shards.find(sid);
      if (sh == shards.end()) throw std::runtime_error("frozen input " + name + ": shard " + sid + " not held");
      t = &sh->second.at(src.at("tensor").get<std::string>());
    }
    check_like(*t, spec, "frozen input");
    frozen_.push_back(*t);
  }
}

void Trainer::load_state(const SafetensorsFile& state) { load_state(state.tensors()); }

void Trainer::load_state(const std::map<std::string, TensorView>& state) {
  pending_.clear();
  pending_shape_.clear();
  for (const auto& n : names_) {
    const auto key = manifest_.at("trainable").at(n).get<std::string>();
    auto it = state.find(key);
    if (it == state.end()) throw std::runtime_error("adapter state lacks " + key);
    const auto& t = it->second;
    if (t.dtype != "F32") throw std::runtime_error("adapter state " + key + " is not fp32");
    std::vector<float> v(t.nbytes / 4);
    std::memcpy(v.data(), t.data, t.nbytes);
    pending_[n] = std::move(v);
    pending_shape_[n] = t.shape;
  }
  m_.clear();
  v_.clear();
  t_ = 0;
}

std::vector<EValue> Trainer::run(const std::vector<TensorView>& batch) {
  const auto& specs = manifest_.at("batch");
  if (batch.size() != specs.size()) throw std::runtime_error("batch has the wrong number of inputs");
  if (frozen_.size() != manifest_.at("frozen").size()) throw std::runtime_error("frozen inputs not bound");
  std::vector<TensorPtr> keep;
  std::vector<EValue> inputs;
  auto add = [&](const TensorView& t) {
    std::vector<executorch::aten::SizesType> sizes(t.shape.begin(), t.shape.end());
    keep.push_back(from_blob(t.data, sizes, scalar_type_of(t.dtype)));
    inputs.emplace_back(*keep.back());
  };
  for (size_t i = 0; i < batch.size(); ++i) {
    check_like(batch[i], specs[i], "batch input");
    add(batch[i]);
  }
  for (const auto& t : frozen_) add(t);
  auto r = module_->execute("forward", inputs);
  if (!r.ok()) throw std::runtime_error("the training step failed (ExecuTorch error " + std::to_string(static_cast<int>(r.error())) + ")");
  return std::move(*r);
}

void Trainer::prepare(const std::vector<TensorView>& batch) {
  if (pending_.empty()) return;
  if (params_.empty()) {  // the parameters are outputs that alias the program's own storage: run once to find them
    auto out = run(batch);
    for (size_t i = 0; i < names_.size(); ++i) {
      auto& p = out[param_start_ + i].toTensor();
      params_[names_[i]] = TensorView{"F32", {p.sizes().begin(), p.sizes().end()}, static_cast<uint8_t*>(p.mutable_data_ptr()), p.nbytes()};
    }
  }
  for (auto& [n, v] : pending_) {  // a state loaded since: put it in
    auto& p = params_.at(n);
    if (p.nbytes != v.size() * 4 || (pending_shape_.count(n) && pending_shape_[n] != p.shape))
      throw std::runtime_error("adapter state " + manifest_.at("trainable").at(n).get<std::string>() +
                               " has another shape than the program's parameter");
    std::memcpy(p.data, v.data(), p.nbytes);
  }
  pending_.clear();
  pending_shape_.clear();
}

float Trainer::evaluate(const std::vector<TensorView>& batch) {
  prepare(batch);
  last_ = run(batch);
  const float loss = last_[0].toTensor().const_data_ptr<float>()[0];
  if (!std::isfinite(loss)) throw std::runtime_error("non-finite validation loss");
  return loss;
}

TensorView Trainer::output(const std::string& name) const {
  const auto& outs = manifest_.value("outputs", nlohmann::json::array());
  for (size_t i = 0; i < outs.size() && i < grad_start_ && i < last_.size(); ++i) {
    if (outs[i].at("name").get<std::string>() != name) continue;
    const auto& t = last_[i].toTensor();
    const auto& d = dtype_of(outs[i].at("dtype").get<std::string>());
    return TensorView{d.safetensors, {t.sizes().begin(), t.sizes().end()},
                      static_cast<uint8_t*>(const_cast<void*>(t.const_data_ptr())), t.nbytes()};
  }
  throw std::runtime_error("the program has no output " + name + " (or nothing ran yet)");
}

uint64_t Trainer::planned_bytes() const { return manifest_.value("planned_bytes", uint64_t{0}); }

float Trainer::step(const std::vector<TensorView>& batch, const AdamW& opt) {
  prepare(batch);
  last_ = run(batch);
  const auto& out = last_;
  const float loss = out[0].toTensor().const_data_ptr<float>()[0];
  if (!std::isfinite(loss)) throw std::runtime_error("non-finite training loss");
  ++t_;
  const float c1 = 1.0f - std::pow(opt.beta1, static_cast<float>(t_));
  const float c2 = 1.0f - std::pow(opt.beta2, static_cast<float>(t_));
  for (size_t i = 0; i < names_.size(); ++i) {  // torch.optim.AdamW (decoupled weight decay)
    const auto& g = out[grad_start_ + i].toTensor();
    const float* gd = g.const_data_ptr<float>();
    auto& p = params_.at(names_[i]);
    float* pd = reinterpret_cast<float*>(p.data);
    const size_t n = p.nbytes / 4;
    auto& m = m_[names_[i]];
    auto& v = v_[names_[i]];
    if (m.empty()) m.assign(n, 0.0f), v.assign(n, 0.0f);
    for (size_t j = 0; j < n; ++j) {
      pd[j] *= 1.0f - opt.lr * opt.weight_decay;
      m[j] = opt.beta1 * m[j] + (1.0f - opt.beta1) * gd[j];
      v[j] = opt.beta2 * v[j] + (1.0f - opt.beta2) * gd[j] * gd[j];
      pd[j] -= opt.lr * (m[j] / c1) / (std::sqrt(v[j] / c2) + opt.eps);
    }
  }
  return loss;
}

std::map<std::string, TensorView> Trainer::state() const {
  std::map<std::string, TensorView> out;
  for (const auto& [n, p] : params_) out[manifest_.at("trainable").at(n).get<std::string>()] = p;
  return out;
}

}  // namespace fedmoe
