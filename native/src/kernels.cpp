#include "kernels.hpp"

extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc);

namespace fedmoe {

void gemm(char ta, char tb, int m, int n, int k, const float* a, int lda, const float* b, int ldb, float* c, int ldc,
          float beta) {
  // the sgemm_ of ExecuTorch's optimized kernel library: the BLAS its own mm uses
  const float one = 1.0f;
  sgemm_(&ta, &tb, &m, &n, &k, &one, a, &lda, b, &ldb, &beta, c, &ldc);
}

bool register_kernels() {
  static const bool ok = [] {
    static std::vector<executorch::runtime::Kernel> kernels;
    append_grouped_kernels(kernels);
    append_lm_head_loss_kernels(kernels);
    return executorch::runtime::register_kernels({kernels.data(), kernels.size()}) == executorch::runtime::Error::Ok;
  }();
  return ok;
}

}  // namespace fedmoe
