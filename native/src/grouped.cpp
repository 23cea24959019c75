// ExecuTorch kernels of fedmoe::grouped_mm and fedmoe::grouped_mm_wgrad (moe_model/grouped.py): each expert's
// linear map on its own rows of an expert-sorted (token, expert) pair list, one BLAS sgemm per expert. Row-major
// tensors are column-major transposes, so the row-major C = A·op(B) is the column-major C^T = op(B)^T·A^T.
#include "kernels.hpp"

#include <cstring>

#include <executorch/extension/kernel_util/make_boxed_from_unboxed_functor.h>
#include <executorch/runtime/kernel/kernel_includes.h>

namespace fedmoe {
namespace {

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

Tensor& grouped_mm_out(KernelRuntimeContext& ctx, const Tensor& x, const Tensor& w, const Tensor& offsets, bool trans,
                       Tensor& out) {
  ET_KERNEL_CHECK_MSG(ctx, x.scalar_type() == ScalarType::Float && w.scalar_type() == ScalarType::Float &&
                               out.scalar_type() == ScalarType::Float && x.dim() == 2 && w.dim() == 3 && out.dim() == 2,
                      InvalidArgument, out, "grouped_mm: fp32 x (P, K), w (n, out, in), out (P, M)");
  const int64_t rows = x.size(0), n = w.size(0), wo = w.size(1), wi = w.size(2);
  const int64_t k = trans ? wo : wi, m = trans ? wi : wo;
  ET_KERNEL_CHECK_MSG(ctx, x.size(1) == k && out.size(0) == rows && out.size(1) == m, InvalidArgument, out,
                      "grouped_mm: shapes do not match");
  ET_KERNEL_CHECK_MSG(ctx, segments(offsets, n, rows), InvalidArgument, out,
                      "grouped_mm: offsets must ascend from 0 within the rows");
  const int64_t* o = offsets.const_data_ptr<int64_t>();
  const float* xp = x.const_data_ptr<float>();
  const float* wp = w.const_data_ptr<float>();
  float* yp = out.mutable_data_ptr<float>();
  std::memset(yp, 0, sizeof(float) * rows * m);
  for (int64_t e = 0; e < n; ++e) {
    const int r = static_cast<int>(o[e + 1] - o[e]);
    if (r == 0) continue;
    const float* we = wp + e * wo * wi;
    // trans: y (r x wi) = x (r x wo) . W (wo x wi); else y (r x wo) = x (r x wi) . W^T
    if (trans)
      gemm('N', 'N', wi, r, wo, we, wi, xp + o[e] * k, k, yp + o[e] * m, m);
    else
      gemm('T', 'N', wo, r, wi, we, wi, xp + o[e] * k, k, yp + o[e] * m, m);
  }
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
  for (int64_t e = 0; e < n; ++e) {
    const int r = static_cast<int>(o[e + 1] - o[e]);
    if (r == 0) continue;
    // dW (go x xi) = g^T (go x r) . x (r x xi)
    gemm('N', 'T', xi, go, r, x.const_data_ptr<float>() + o[e] * xi, xi, g.const_data_ptr<float>() + o[e] * go, go,
         dp + e * go * xi, xi);
  }
  return out;
}

constexpr char kGroupedMm[] = "fedmoe::grouped_mm.out";
constexpr char kGroupedMmWgrad[] = "fedmoe::grouped_mm_wgrad.out";

}  // namespace

void append_grouped_kernels(std::vector<executorch::runtime::Kernel>& out) {
  out.push_back(executorch::extension::make_boxed_kernel(kGroupedMm, EXECUTORCH_FN(grouped_mm_out, kGroupedMm)));
  out.push_back(executorch::extension::make_boxed_kernel(kGroupedMmWgrad,
                                                         EXECUTORCH_FN(grouped_mm_wgrad_out, kGroupedMmWgrad)));
}

}  // namespace fedmoe
