// The project's own ExecuTorch operators: fedmoe::grouped_mm, fedmoe::grouped_mm_int8 and fedmoe::grouped_mm_wgrad
// (exact top-k expert dispatch, moe_model/grouped.py; grouped.cpp), fedmoe::lm_head_loss (a causal LM's output layer and
// loss without its logits, moe_model/lm_head_loss.py; lm_head_loss.cpp) and fedmoe::gemm (a matrix product with its
// operands' transposes as flags, on the thread pool; moe_model/gemm.py; gemm.cpp).
#pragma once

#include <vector>

#include <executorch/runtime/kernel/operator_registry.h>

namespace fedmoe {

// Register the operators' .out kernels with ExecuTorch's kernel registry, once per process (later calls return the first
// call's result); true when they are registered. A program that uses them needs them before it loads.
bool register_kernels();

// Each file's kernels, for register_kernels.
void append_grouped_kernels(std::vector<executorch::runtime::Kernel>& out);
void append_lm_head_loss_kernels(std::vector<executorch::runtime::Kernel>& out);
void append_gemm_kernels(std::vector<executorch::runtime::Kernel>& out);

// column-major C (m x n) = op(A) (m x k) . op(B) (k x n) in fp32 (BLAS sgemm, beta 0)
void gemm(char ta, char tb, int m, int n, int k, const float* a, int lda, const float* b, int ldb, float* c, int ldc,
          float beta = 0.0f);

}  // namespace fedmoe
