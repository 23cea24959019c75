// ExecuTorch kernel of fedmoe::gemm (moe_model/gemm.py): C = op(A) . op(B) with the transposes as BLAS flags, not
// copies, the rows of C (or its columns, where it has more of them) split among ExecuTorch's thread pool, one sgemm
// per part. Row-major tensors are column-major transposes: the row-major C (M x N) = op(A) op(B) is the column-major
// C^T = op(B)^T op(A)^T.
#include "kernels.hpp"

#include <algorithm>

#include <executorch/extension/kernel_util/make_boxed_from_unboxed_functor.h>
#include <executorch/runtime/kernel/kernel_includes.h>
#include <executorch/runtime/kernel/thread_parallel_interface.h>

namespace fedmoe {
namespace {

using executorch::aten::ScalarType;
using executorch::aten::Tensor;
using executorch::runtime::KernelRuntimeContext;

constexpr int64_t kMinPart = 16;  // rows or columns per thread's part, at least

Tensor& gemm_out(KernelRuntimeContext& ctx, const Tensor& a, const Tensor& b, bool trans_a, bool trans_b,
                 Tensor& out) {
  ET_KERNEL_CHECK_MSG(ctx, a.scalar_type() == ScalarType::Float && b.scalar_type() == ScalarType::Float &&
                               out.scalar_type() == ScalarType::Float && a.dim() == 2 && b.dim() == 2 && out.dim() == 2,
                      InvalidArgument, out, "gemm: fp32 2-D a, b and out");
  const int64_t m = trans_a ? a.size(1) : a.size(0), k = trans_a ? a.size(0) : a.size(1);
  const int64_t n = trans_b ? b.size(0) : b.size(1);
  ET_KERNEL_CHECK_MSG(ctx, (trans_b ? b.size(1) : b.size(0)) == k && out.size(0) == m && out.size(1) == n,
                      InvalidArgument, out, "gemm: shapes do not match");
  const float* ap = a.const_data_ptr<float>();
  const float* bp = b.const_data_ptr<float>();
  float* cp = out.mutable_data_ptr<float>();
  const int lda = static_cast<int>(trans_a ? m : k), ldb = static_cast<int>(trans_b ? k : n);
  const char ta = trans_a ? 'T' : 'N', tb = trans_b ? 'T' : 'N';
  if (m == 0 || n == 0) return out;
  if (k == 0) {
    std::fill(cp, cp + m * n, 0.0f);
    return out;
  }
  if (m >= n) {  // rows [r0, r1) of C: those of op(A)
    executorch::extension::parallel_for(0, m, kMinPart, [&](int64_t r0, int64_t r1) {
      gemm(tb, ta, static_cast<int>(n), static_cast<int>(r1 - r0), static_cast<int>(k), bp, ldb,
           ap + (trans_a ? r0 : r0 * k), lda, cp + r0 * n, static_cast<int>(n));
    });
  } else {  // columns [c0, c1) of C: those of op(B)
    executorch::extension::parallel_for(0, n, kMinPart, [&](int64_t c0, int64_t c1) {
      gemm(tb, ta, static_cast<int>(c1 - c0), static_cast<int>(m), static_cast<int>(k), bp + (trans_b ? c0 * k : c0),
           ldb, ap, lda, cp + c0, static_cast<int>(n));
    });
  }
  return out;
}

constexpr char kGemm[] = "fedmoe::gemm.out";

}  // namespace

void append_gemm_kernels(std::vector<executorch::runtime::Kernel>& out) {
  out.push_back(executorch::extension::make_boxed_kernel(kGemm, EXECUTORCH_FN(gemm_out, kGemm)));
}

}  // namespace fedmoe
