// Python bindings of fastpar._C: input validation (same messages as fastpar._torch_ops) and device dispatch.
// Tensor lists are read straight from the Python sequence, without per-tensor refcount traffic: with thousands
// of small gradients the per-call overhead is otherwise a visible share of the copy time.
// Only what the bindings use (not <torch/extension.h>, which pulls in the whole C++ frontend and doubles the
// compile time): pybind11 with torch's tensor casters, the THPVariable C API, and the one ATen op called here.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <string>
#include <vector>

#include "ops/bucket_ops.h"
#include "text.h"

namespace fastpar::shm {
void bind(pybind11::module_& m);  // shm/bind.cpp: the "fastpar" torch.distributed backend
}
namespace fastpar::ddp {
void bind(pybind11::module_& m);  // ddp/bucket_launcher.cpp: DDP's per-gradient hot path
}

namespace fastpar {
namespace {

bool supported(at::ScalarType type) { return type == at::kFloat || type == at::kHalf || type == at::kBFloat16; }

// Python spellings, so messages read exactly like the pure-torch fallback's: "torch.float64", "(2, 3)".
// Only called on the error path (GIL held), so asking Python for the name costs nothing that matters.
std::string dtype_name(const at::Tensor& t) { return py::str(py::cast(t).attr("dtype")); }

std::string shape_tuple(at::IntArrayRef sizes) {
  std::string out = "(";
  for (size_t i = 0; i < sizes.size(); ++i) out += text(i ? ", " : "", sizes[i]);
  return out + (sizes.size() == 1 ? ",)" : ")");
}

// `what` is built only on failure: building "tensors[i]" strings for thousands of valid tensors would cost more
// than copying them.
template <typename... Name>
void check_dtype(const char* op, const at::Tensor& t, const Name&... what) {
  if (supported(t.scalar_type())) return;
  TORCH_CHECK_TYPE(false, text(op, ": ", what..., " has dtype ", dtype_name(t),
                               "; supported dtypes are float32, float16 and bfloat16"));
}

void check_flat(const char* op, const char* name, const at::Tensor& flat) {
  check_dtype(op, flat, name);
  TORCH_CHECK_VALUE(flat.dim() == 1, text(op, ": ", name, " must be 1-D, got shape ", shape_tuple(flat.sizes()),
                    "; pass buffer.view(-1)"));
  TORCH_CHECK_VALUE(flat.is_contiguous(), text(op, ": ", name, " must be contiguous; pass ", name,
                    ".contiguous() and copy back"));
}

void check_device(at::Device device) {
#ifdef FASTPAR_WITH_CUDA
  if (device.is_cuda()) return;
#endif
  TORCH_CHECK_VALUE(device.is_cpu(), text("fastpar: tensors on ", device,
                                          " are not supported by this build of fastpar._C; use CPU or CUDA tensors"));
}

// Borrowed view of a Python sequence of tensors; it keeps them alive for the duration of the call.
class TensorList {
 public:
  explicit TensorList(py::handle seq)
      : fast_(py::reinterpret_steal<py::object>(PySequence_Fast(seq.ptr(), "expected a sequence of tensors"))) {
    if (!fast_) throw py::error_already_set();
    items_ = PySequence_Fast_ITEMS(fast_.ptr());
    size_ = PySequence_Fast_GET_SIZE(fast_.ptr());
  }
  Py_ssize_t size() const { return size_; }
  PyObject* item(Py_ssize_t i) const { return items_[i]; }

 private:
  py::object fast_;
  PyObject** items_ = nullptr;
  Py_ssize_t size_ = 0;
};

// One pass over the list (each tensor's metadata is touched once, which matters with thousands of tensors):
// validates like _torch_ops._check_list, in the same order, and calls visit(tensor, numel) for each.
template <typename Visit>
void for_each_checked(const char* op, const TensorList& tensors, const at::Tensor& flat, const char* flat_name,
                      Visit&& visit) {
  int64_t total = 0;
  const at::Device device = flat.device();
  // After a large copy each tensor's metadata (PyObject -> TensorImpl -> StorageImpl) is cold: three dependent cache
  // misses per tensor, ~15% of pack time in perf for 4000 x 4 KB tensors. Prefetch it ahead, in stages. (Inline on
  // purpose: GCC deletes calls to a helper that only prefetches, treating it as free of side effects.)
  constexpr Py_ssize_t kAhead = 8;
  for (Py_ssize_t i = 0; i < tensors.size(); ++i) {
    if (i + 3 * kAhead < tensors.size()) __builtin_prefetch(tensors.item(i + 3 * kAhead));
    if (i + 2 * kAhead < tensors.size() && THPVariable_CheckExact(tensors.item(i + 2 * kAhead))) {
      const c10::TensorImpl* impl = THPVariable_Unpack(tensors.item(i + 2 * kAhead)).unsafeGetTensorImpl();
      for (int line = 0; line < 4; ++line) __builtin_prefetch(reinterpret_cast<const char*>(impl) + 64 * line);
    }
    if (i + kAhead < tensors.size() && THPVariable_CheckExact(tensors.item(i + kAhead))) {
      const c10::TensorImpl* impl = THPVariable_Unpack(tensors.item(i + kAhead)).unsafeGetTensorImpl();
      __builtin_prefetch(impl->unsafe_storage().unsafeGetStorageImpl());
    }
    PyObject* obj = tensors.item(i);
    TORCH_CHECK_TYPE(THPVariable_Check(obj),
                     text(op, ": tensors[", i, "] must be a torch.Tensor, got ", Py_TYPE(obj)->tp_name));
    const at::Tensor& t = THPVariable_Unpack(obj);
    check_dtype(op, t, "tensors[", i, "]");
    TORCH_CHECK_VALUE(t.device() == device, text(op, ": tensors[", i, "] is on ", t.device(), " but ", flat_name,
                                                 " is on ", device, "; move them to one device"));
    const int64_t n = t.numel();
    total += n;
    visit(t, n);
  }
  TORCH_CHECK_VALUE(total <= flat.numel(), text(op, ": ", flat_name, " has ", flat.numel(),
                                                " elements but the tensors hold ", total, "; allocate ", flat_name,
                                                " with at least ", total, " elements"));
}

void scaled_copy(const std::vector<CopySpan>& spans, float scale, bool accumulate, at::Device device) {
#ifdef FASTPAR_WITH_CUDA
  if (device.is_cuda()) return scaled_copy_cuda(spans, scale, accumulate, device);
#endif
  py::gil_scoped_release no_gil;
  scaled_copy_cpu(spans, scale, accumulate);
}

at::Tensor pack(py::handle tensors_seq, const at::Tensor& out, double scale) {
  check_flat("pack", "out", out);
  check_device(out.device());
  const TensorList tensors(tensors_seq);
  std::vector<CopySpan> spans;
  spans.reserve(tensors.size());
  std::vector<at::Tensor> keep_alive;  // contiguous copies of strided inputs
  char* dst = static_cast<char*>(out.data_ptr());
  const size_t out_size = out.element_size();
  const at::ScalarType out_type = out.scalar_type();
  // Nothing is written until every tensor has passed the checks.
  for_each_checked("pack", tensors, out, "out", [&](const at::Tensor& t, int64_t n) {
    if (n == 0) return;
    const void* src = t.is_contiguous() ? t.const_data_ptr() : keep_alive.emplace_back(t.contiguous()).const_data_ptr();
    spans.push_back({src, dst, n, t.scalar_type(), out_type});
    dst += n * out_size;
  });
  scaled_copy(spans, static_cast<float>(scale), false, out.device());
  return out;
}

void unpack(const at::Tensor& flat, py::handle tensors_seq, double scale, bool accumulate) {
  check_flat("unpack", "flat", flat);
  check_device(flat.device());
  const TensorList tensors(tensors_seq);
  std::vector<CopySpan> spans;
  spans.reserve(tensors.size());
  // Strided targets are computed in a contiguous copy (holding their values, for accumulate) and copied back.
  std::vector<std::pair<at::Tensor, at::Tensor>> strided;
  const char* src = static_cast<const char*>(flat.const_data_ptr());
  const size_t flat_size = flat.element_size();
  const at::ScalarType flat_type = flat.scalar_type();
  for_each_checked("unpack", tensors, flat, "flat", [&](const at::Tensor& t, int64_t n) {
    if (n == 0) return;
    void* dst = nullptr;
    if (t.is_contiguous()) {
      dst = t.data_ptr();
    } else {
      strided.emplace_back(t, accumulate ? t.contiguous() : at::empty(t.sizes(), t.options()));
      dst = strided.back().second.data_ptr();
    }
    spans.push_back({src, dst, n, flat_type, t.scalar_type()});
    src += n * flat_size;
  });
  scaled_copy(spans, static_cast<float>(scale), accumulate, flat.device());
  for (auto& [target, temp] : strided) target.copy_(temp);
}

std::tuple<at::Tensor, at::Tensor> norm_and_finite(py::handle flats_seq) {
  const TensorList flats(flats_seq);
  at::Device device(at::kCPU);
  std::vector<ReduceSpan> spans;
  std::vector<at::Tensor> keep_alive;
  for (Py_ssize_t i = 0; i < flats.size(); ++i) {
    PyObject* obj = flats.item(i);
    TORCH_CHECK_TYPE(THPVariable_Check(obj),
                     text("norm_and_finite: flats[", i, "] must be a torch.Tensor, got ", Py_TYPE(obj)->tp_name));
    const at::Tensor* f = &THPVariable_Unpack(obj);
    check_dtype("norm_and_finite", *f, "flats[", i, "]");
    if (i == 0) device = f->device();
    TORCH_CHECK_VALUE(f->device() == device, text("norm_and_finite: flats[", i, "] is on ", f->device(),
                                                  " but flats[0] is on ", device, "; move them to one device"));
  }
  check_device(device);
  for (Py_ssize_t i = 0; i < flats.size(); ++i) {
    const at::Tensor* f = &THPVariable_Unpack(flats.item(i));
    if (f->numel() == 0) continue;
    if (!f->is_contiguous()) f = &keep_alive.emplace_back(f->contiguous());
    spans.push_back({f->const_data_ptr(), f->numel(), f->scalar_type()});
  }
#ifdef FASTPAR_WITH_CUDA
  if (device.is_cuda()) return norm_and_finite_cuda(spans, device);
#endif
  py::gil_scoped_release no_gil;
  return norm_and_finite_cpu(spans);
}

bool has_cuda() {
#ifdef FASTPAR_WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace
}  // namespace fastpar

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fastpar bucket kernels (see fastpar.ops for the documented API)";
  m.def("pack", &fastpar::pack, py::arg("tensors"), py::arg("out"), py::arg("scale") = 1.0,
        "Copy tensors, flattened and in order, into 1-D out, times scale, cast to out.dtype; returns out");
  m.def("unpack", &fastpar::unpack, py::arg("flat"), py::arg("tensors"), py::arg("scale") = 1.0,
        py::arg("accumulate") = false, "Write (or add) flat * scale into the tensors, cast to their dtypes");
  m.def("norm_and_finite", &fastpar::norm_and_finite, py::arg("flats"),
        "(L2 norm as fp32 0-d tensor, all elements finite as bool 0-d tensor), on the buffers' device");
  m.def("has_cuda", &fastpar::has_cuda, "whether the CUDA kernels were compiled in");
  fastpar::shm::bind(m);
  fastpar::ddp::bind(m);
}
