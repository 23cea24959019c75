// libfedmoe_kernels.so: the project's operators registered when the library is loaded, for ExecuTorch's Python runtime
// (its pybindings share libexecutorch.so's kernel registry; fedmoe.native.load_kernels loads this).
#include "kernels.hpp"

namespace {
const bool registered = fedmoe::register_kernels();
}
