// ExecuTorch kernels of fedmoe::grouped_mm, fedmoe::grouped_mm_int8 and fedmoe::grouped_mm_wgrad
// (moe_model/grouped.py): each expert's linear map on its own rows of an expert-sorted (token, expert) pair list, one
// BLAS sgemm per expert, the experts shared among ExecuTorch's thread pool (each writes only its own rows or its own
// weight gradient). The int8 form dequantizes one expert's weight at a time into a buffer of its own, so no stack of
// fp32 weights is ever held. Row-major tensors are column-major transposes, so the row-major C = A·op(B) is the
// column-major C^T = op(B)^T·A^T.
#include "kernels.hpp"

#include <cstring>
#include <vector>

#include <executorch/extension/kernel_util/make_boxed_from_unboxed_functor.h>
#include <executorch/runtime/kernel/kernel_includes.h>
#include <executorch/runtime/kernel/thread_parallel_interface.h>

namespace fedmoe {
namespace {

using executorch::aten::ArrayRef;
using executorch::aten::ScalarType;
using executorch::aten::Tensor;
using executorch::runtime::Error;
using executorch::runtime::KernelRuntimeContext;

// the segments of offsets (n+1 ascending int64 from 0, within rows), or false
bool segments(const Tensor& offsets, int64_t n, int64_t rows) {
  if (offsets.scalar_type() != ScalarType::Long || offsets.dim() != 1 || offsets.size(0) != n + 1) return false;
  const int64_t* o = offsets.const_data_ptr<int64_t>();
  if (o[0] != 0 || o[n] > rows) return false;
  for (int64_t e = 0; e < n; ++e)
    if (o[e + 1] < o[e]) return false;
  return true;
}

// one expert's rows [a, b): trans: y (r x wi) = x (r x wo) . W (wo x wi); else y (r x wo) = x (r x wi) . W^T
void expert_mm(const float* w, int64_t wo, int64_t wi, bool trans, const float* x, float* y, int64_t a, int64_t b) {
  const int r = static_cast<int>(b - a);
  if (r == 0) return;
  const int64_t k = trans ? wo : wi, m = trans ? wi : wo;
  if (trans)
    gemm('N', 'N', wi, r, wo, w, wi, x + a * k, k, y + a * m, m);
  else
    gemm('T', 'N', wo, r, wi, w, wi, x + a * k, k, y + a * m, m);
}

// x (P, K) and out (P, M) fp32 for n experts' weights of (wo, wi), and offsets that ascend from 0 within P
bool rows_ok(const Tensor& x, const Tensor& offsets, int64_t n, int64_t wo, int64_t wi, bool trans, const Tensor& out) {
  return x.scalar_type() == ScalarType::Float && out.scalar_type() == ScalarType::Float && x.dim() == 2 &&
         out.dim() == 2 && x.size(1) == (trans ? wo : wi) && out.size(0) == x.size(0) &&
         out.size(1) == (trans ? wi : wo) && segments(offsets, n, x.size(0));
}

// out = each expert's rows of x through its weight, weight_of(e, buffer) -> (wo, wi) fp32 (buffer: the calling
// thread's own, for a weight it has to compute); the experts shared among the thread pool
template <class WeightOf>
void expert_products(const Tensor& x, const Tensor& offsets, int64_t n, int64_t wo, int64_t wi, bool trans,
                     Tensor& out, WeightOf weight_of) {
  const int64_t* o = offsets.const_data_ptr<int64_t>();
  const float* xp = x.const_data_ptr<float>();
  float* yp = out.mutable_data_ptr<float>();
  std::memset(yp, 0, sizeof(float) * out.size(0) * out.size(1));
  executorch::extension::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer;
    for (int64_t e = begin; e < end; ++e)
      if (o[e + 1] > o[e]) expert_mm(weight_of(e, buffer), wo, wi, trans, xp, yp, o[e], o[e + 1]);
  });
}

Tensor& grouped_mm_out(KernelRuntimeContext& ctx, const Tensor& x, const Tensor& w, const Tensor& offsets, bool trans,
                       Tensor& out) {
  ET_KERNEL_CHECK_MSG(ctx, w.scalar_type() == ScalarType::Float && w.dim() == 3, InvalidArgument, out,
                      "grouped_mm: fp32 w (n, out, in)");
  const int64_t n = w.size(0), wo = w.size(1), wi = w.size(2);
  ET_KERNEL_CHECK_MSG(ctx, rows_ok(x, offsets, n, wo, wi, trans, out), InvalidArgument, out,
                      "grouped_mm: fp32 x (P, K) and out (P, M) of w's sizes, offsets ascending from 0 within P");
  const float* wp = w.const_data_ptr<float>();
  expert_products(x, offsets, n, wo, wi, trans, out, [&](int64_t e, std::vector<float>&) { return wp + e * wo * wi; });
  return out;
}

Tensor& grouped_mm_int8_out(KernelRuntimeContext& ctx, const Tensor& x, ArrayRef<Tensor> weight,
                            ArrayRef<Tensor> scale, const Tensor& offsets, bool trans, Tensor& out) {
  const int64_t n = static_cast<int64_t>(weight.size());
  ET_KERNEL_CHECK_MSG(ctx, n > 0 && scale.size() == weight.size() && weight[0].dim() == 2, InvalidArgument, out,
                      "grouped_mm_int8: n int8 weights (out, in) and n scales (out,)");
  const int64_t wo = weight[0].size(0), wi = weight[0].size(1);
  for (int64_t e = 0; e < n; ++e)
    ET_KERNEL_CHECK_MSG(ctx, weight[e].scalar_type() == ScalarType::Char && weight[e].dim() == 2 &&
                                 weight[e].size(0) == wo && weight[e].size(1) == wi &&
                                 scale[e].scalar_type() == ScalarType::Float && scale[e].dim() == 1 &&
                                 scale[e].size(0) == wo,
                        InvalidArgument, out, "grouped_mm_int8: n int8 weights (out, in) of one shape, n fp32 scales (out,)");
  ET_KERNEL_CHECK_MSG(ctx, rows_ok(x, offsets, n, wo, wi, trans, out), InvalidArgument, out,
                      "grouped_mm_int8: fp32 x (P, K) and out (P, M) of the weights' sizes, offsets ascending from 0 "
                      "within P");
  expert_products(x, offsets, n, wo, wi, trans, out, [&](int64_t e, std::vector<float>& w) {
    // one expert's dequantized weight at a time
    w.resize(static_cast<size_t>(wo * wi));
    const int8_t* q = weight[e].const_data_ptr<int8_t>();
    const float* s = scale[e].const_data_ptr<float>();
    for (int64_t i = 0; i < wo; ++i)
      for (int64_t j = 0; j < wi; ++j) w[i * wi + j] = static_cast<float>(q[i * wi + j]) * s[i];
    return static_cast<const float*>(w.data());
  });
  return out;
}

Tensor& grouped_mm_wgrad_out(KernelRuntimeContext& ctx, const Tensor& g, const Tensor& x, const Tensor& offsets,
                             Tensor& out) {
  ET_KERNEL_CHECK_MSG(ctx, g.scalar_type() == ScalarType::Float && x.scalar_type() == ScalarType::Float &&
                               out.scalar_type() == ScalarType::Float && g.dim() == 2 && x.dim() == 2 &&
                               out.dim() == 3 && g.size(0) == x.size(0),
                      InvalidArgument, out, "grouped_mm_wgrad: fp32 g (P, out), x (P, in), out (n, out, in)");
  const int64_t rows = g.size(0), n = out.size(0), go = g.size(1), xi = x.size(1);
  ET_KERNEL_CHECK_MSG(ctx, out.size(1) == go && out.size(2) == xi, InvalidArgument, out,
                      "grouped_mm_wgrad: shapes do not match");
  ET_KERNEL_CHECK_MSG(ctx, segments(offsets, n, rows), InvalidArgument, out,
                      "grouped_mm_wgrad: offsets must ascend from 0 within the rows");
  const int64_t* o = offsets.const_data_ptr<int64_t>();
  float* dp = out.mutable_data_ptr<float>();
  std::memset(dp, 0, sizeof(float) * n * go * xi);
  executorch::extension::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t e = begin; e < end; ++e) {
      const int r = static_cast<int>(o[e + 1] - o[e]);
      if (r == 0) continue;
      // dW (go x xi) = g^T (go x r) . x (r x xi)
      gemm('N', 'T', xi, go, r, x.const_data_ptr<float>() + o[e] * xi, xi, g.const_data_ptr<float>() + o[e] * go, go,
           dp + e * go * xi, xi);
    }
  });
  return out;
}

constexpr char kGroupedMm[] = "fedmoe::grouped_mm.out";
constexpr char kGroupedMmWgrad[] = "fedmoe::grouped_mm_wgrad.out";
constexpr char kGroupedMmInt8[] = "fedmoe::grouped_mm_int8.out";

}  // namespace

void append_grouped_kernels(std::vector<executorch::runtime::Kernel>& out) {
  out.push_back(executorch::extension::make_boxed_kernel(kGroupedMm, EXECUTORCH_FN(grouped_mm_out, kGroupedMm)));
  out.push_back(executorch::extension::make_boxed_kernel(kGroupedMmWgrad,
                                                         EXECUTORCH_FN(grouped_mm_wgrad_out, kGroupedMmWgrad)));
  out.push_back(executorch::extension::make_boxed_kernel(kGroupedMmInt8,
                                                         EXECUTORCH_FN(grouped_mm_int8_out, kGroupedMmInt8)));
}

}  // namespace fedmoe
