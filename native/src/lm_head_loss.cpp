// ExecuTorch kernel of fedmoe::lm_head_loss (moe_model/lm_head_loss.py): a causal LM's int8 output layer and
// next-token loss, a block of the vocabulary at a time, never holding the (tokens, vocabulary) logits. Two passes:
// the log-sum-exp, arg-max and target logit of each token; then the loss's gradient with respect to the hidden
// state, sum_v p_v w_v - w_target. Each pass dequantizes a block of rows and computes its logits with one sgemm.
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include <executorch/runtime/kernel/kernel_includes.h>

#include "kernels.hpp"

namespace fedmoe {
namespace {

using executorch::aten::ScalarType;
using executorch::aten::Tensor;
using executorch::runtime::EValue;
using executorch::runtime::KernelRuntimeContext;
using executorch::runtime::Span;

constexpr int64_t kIgnore = -100;     // moe_model.objectives.IGNORE
constexpr int64_t kBlockRows = 1024;  // vocabulary rows per block: 1.5 MiB of weights at H = 384

bool shapes_ok(const Tensor& h, const Tensor& w, const Tensor& scale, const Tensor& targets, const Tensor& loss,
               const Tensor& correct, const Tensor& grad) {
  if (h.scalar_type() != ScalarType::Float || w.scalar_type() != ScalarType::Char ||
      scale.scalar_type() != ScalarType::Float || targets.scalar_type() != ScalarType::Long ||
      loss.scalar_type() != ScalarType::Float || correct.scalar_type() != ScalarType::Float ||
      grad.scalar_type() != ScalarType::Float)
    return false;
  if (h.dim() != 2 || w.dim() != 2 || scale.dim() != 1 || targets.dim() != 1 || loss.dim() != 1 ||
      correct.dim() != 1 || grad.dim() != 2)
    return false;
  const auto n = h.size(0), d = h.size(1), v = w.size(0);
  return w.size(1) == d && scale.size(0) == v && targets.size(0) == n && loss.size(0) == n && correct.size(0) == n &&
         grad.size(0) == n && grad.size(1) == d;
}

void lm_head_loss_out(KernelRuntimeContext& ctx, const Tensor& h, const Tensor& w, const Tensor& scale,
                      const Tensor& targets, Tensor& loss, Tensor& correct, Tensor& grad) {
  ET_KERNEL_CHECK_MSG(ctx, shapes_ok(h, w, scale, targets, loss, correct, grad), InvalidArgument, ,
                      "lm_head_loss: fp32 h (N, H), int8 weight (V, H), fp32 scale (V,), int64 targets (N,)");
  const int64_t n = h.size(0), d = h.size(1), v = w.size(0);
  const float* hp = h.const_data_ptr<float>();
  const int8_t* wp = w.const_data_ptr<int8_t>();
  const float* sp = scale.const_data_ptr<float>();
  const int64_t* tp = targets.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    ET_KERNEL_CHECK_MSG(ctx, tp[i] == kIgnore || (tp[i] >= 0 && tp[i] < v), InvalidArgument, ,
                        "lm_head_loss: a target outside the vocabulary");
  const int64_t rows = std::min(kBlockRows, v);
  std::vector<float> block(static_cast<size_t>(rows * d)), logits(static_cast<size_t>(n * rows));
  auto dequantize = [&](int64_t v0, int64_t vb) {
    for (int64_t j = 0; j < vb; ++j) {
      const float s = sp[v0 + j];
      const int8_t* src = wp + (v0 + j) * d;
      float* dst = block.data() + j * d;
      for (int64_t k = 0; k < d; ++k) dst[k] = static_cast<float>(src[k]) * s;
    }
  };
  // logits (n x vb, row-major) = h (n x d) . block^T
  auto block_logits = [&](int64_t vb) {
    gemm('T', 'N', static_cast<int>(vb), static_cast<int>(n), static_cast<int>(d), block.data(), static_cast<int>(d),
         hp, static_cast<int>(d), logits.data(), static_cast<int>(vb));
  };
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> mx(n, -inf), sum(n, 0.0f), best(n, -inf), target(n, 0.0f);
  std::vector<int64_t> arg(n, -1);
  for (int64_t v0 = 0; v0 < v; v0 += rows) {
    const int64_t vb = std::min(rows, v - v0);
    dequantize(v0, vb);
    block_logits(vb);
    for (int64_t i = 0; i < n; ++i) {
      const float* l = logits.data() + i * vb;
      float bm = -inf;
      for (int64_t j = 0; j < vb; ++j) {
        bm = std::max(bm, l[j]);
        if (l[j] > best[i]) best[i] = l[j], arg[i] = v0 + j;
      }
      const float m = std::max(mx[i], bm);
      float s = sum[i] * std::exp(mx[i] - m);
      for (int64_t j = 0; j < vb; ++j) s += std::exp(l[j] - m);
      mx[i] = m, sum[i] = s;
      if (tp[i] >= v0 && tp[i] < v0 + vb) target[i] = l[tp[i] - v0];
    }
  }
  float* lp = loss.mutable_data_ptr<float>();
  float* cp = correct.mutable_data_ptr<float>();
  std::vector<float> lse(n);
  for (int64_t i = 0; i < n; ++i) {
    lse[i] = mx[i] + std::log(sum[i]);
    const bool valid = tp[i] != kIgnore;
    lp[i] = valid ? lse[i] - target[i] : 0.0f;
    cp[i] = valid && arg[i] == tp[i] ? 1.0f : 0.0f;
  }
  float* gp = grad.mutable_data_ptr<float>();
  std::memset(gp, 0, sizeof(float) * n * d);
  for (int64_t v0 = 0; v0 < v; v0 += rows) {
    const int64_t vb = std::min(rows, v - v0);
    dequantize(v0, vb);
    block_logits(vb);
    for (int64_t i = 0; i < n; ++i) {
      float* l = logits.data() + i * vb;
      const bool valid = tp[i] != kIgnore;
      for (int64_t j = 0; j < vb; ++j) l[j] = valid ? std::exp(l[j] - lse[i]) : 0.0f;
    }
    // grad (n x d) += p (n x vb) . block (vb x d)
    gemm('N', 'N', static_cast<int>(d), static_cast<int>(n), static_cast<int>(vb), block.data(), static_cast<int>(d),
         logits.data(), static_cast<int>(vb), gp, static_cast<int>(d), 1.0f);
  }
  for (int64_t i = 0; i < n; ++i) {
    if (tp[i] == kIgnore) continue;
    const float s = sp[tp[i]];
    const int8_t* row = wp + tp[i] * d;
    for (int64_t k = 0; k < d; ++k) gp[i * d + k] -= static_cast<float>(row[k]) * s;
  }
}

// the boxed form: the stack holds h, weight, scale, targets, then the out tensors loss, correct, grad_h (and the
// returned values, which alias them)
void lm_head_loss_boxed(KernelRuntimeContext& ctx, Span<EValue*> stack) {
  ET_KERNEL_CHECK_MSG(ctx, stack.size() >= 7, InvalidArgument, , "lm_head_loss: %zu values on the stack, expected 7",
                      stack.size());
  lm_head_loss_out(ctx, stack[0]->toTensor(), stack[1]->toTensor(), stack[2]->toTensor(), stack[3]->toTensor(),
                   stack[4]->toTensor(), stack[5]->toTensor(), stack[6]->toTensor());
}

}  // namespace

void append_lm_head_loss_kernels(std::vector<executorch::runtime::Kernel>& out) {
  out.emplace_back("fedmoe::lm_head_loss.out", lm_head_loss_boxed);
}

}  // namespace fedmoe
