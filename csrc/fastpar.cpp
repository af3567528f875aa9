// Placeholder module definition; the kernels land with the foundation issue.
#include <torch/extension.h>

static bool has_cuda() {
#ifdef FASTPAR_WITH_CUDA
  return true;
#else
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("has_cuda", &has_cuda, "whether the CUDA kernels were compiled in"); }
