// Python bindings of the same-host backend (fastpar._C.ShmBackend and the segment helpers used by
// fastpar/comm/backend.py, which registers the backend with torch.distributed).
#include <pybind11/chrono.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <string>
#include <vector>

#include "shm/backend.h"
#include "text.h"

namespace fastpar::shm {

// Holder of the Python object, as torch holds its own backends: the last reference may go from Python with the GIL
// held, and the backend's destructor joins its worker, which may need the GIL for a future callback: let it go.
template <typename T>
class NoGilHolder {
 public:
  NoGilHolder() = default;
  explicit NoGilHolder(T* raw) : ptr_(c10::intrusive_ptr<T>::unsafe_steal_from_new(raw)) {}
  explicit NoGilHolder(c10::intrusive_ptr<T> ptr) : ptr_(std::move(ptr)) {}
  NoGilHolder(const NoGilHolder&) = default;
  NoGilHolder(NoGilHolder&&) noexcept = default;
  NoGilHolder& operator=(const NoGilHolder&) = default;
  NoGilHolder& operator=(NoGilHolder&&) noexcept = default;
  ~NoGilHolder() {
    if (ptr_ && PyGILState_Check()) {
      pybind11::gil_scoped_release no_gil;
      ptr_.reset();
    }
  }
  T* get() const { return ptr_.get(); }

 private:
  c10::intrusive_ptr<T> ptr_;
};

}  // namespace fastpar::shm

PYBIND11_DECLARE_HOLDER_TYPE(T, fastpar::shm::NoGilHolder<T>, true)

namespace fastpar::shm {

void bind(pybind11::module_& m) {
  namespace py = pybind11;
  // module_local: the prebuilt fastpar._C and a JIT-built copy may both be loaded in one process (each binds its
  // own ShmBackend; torch still takes either as a c10d Backend, but hands it back to Python as a plain Backend:
  // shm_backend_state below reads it from there).
  py::class_<ShmBackend, c10d::Backend, NoGilHolder<ShmBackend>>(
      m, "ShmBackend", py::module_local(),
      "torch.distributed backend 'fastpar': same-host collectives in shared memory, the rest on gloo")
      .def(py::init([](int rank, int size, const c10::intrusive_ptr<c10d::Backend>& gloo,
                       std::chrono::milliseconds timeout) {
             return NoGilHolder<ShmBackend>(c10::make_intrusive<ShmBackend>(rank, size, gloo, timeout));
           }),
           py::arg("rank"), py::arg("size"), py::arg("gloo"), py::arg("timeout"))
      .def("attach", &ShmBackend::attach, py::arg("name"), py::arg("token"),
           py::call_guard<py::gil_scoped_release>(),
           "Map the group's segment and join it; returns '' or why not (then everything goes to gloo)")
      .def(
          "attach_nodes",
          [](ShmBackend& self, const std::string& name, uint64_t token, const std::vector<int>& node_of,
             const py::object& leaders) {
            c10::intrusive_ptr<c10d::Backend> leaders_backend;
            if (!leaders.is_none()) leaders_backend = leaders.cast<c10::intrusive_ptr<c10d::Backend>>();
            py::gil_scoped_release no_gil;
            return self.attach_nodes(name, token, node_of, std::move(leaders_backend));
          },
          py::arg("name"), py::arg("token"), py::arg("node_of"), py::arg("leaders"),
          "On a group spanning nodes: map this node's segment (node_of: every rank's node, numbered by lowest rank; "
          "leaders: the node leaders' gloo backend, None off them); returns '' or why not")
      .def_property_readonly("nodes", &ShmBackend::nodes)
      .def("detach", &ShmBackend::detach, py::arg("reason"), py::call_guard<py::gil_scoped_release>(),
           "Leave the segment: everything goes to gloo from now on")
      .def_property_readonly("shm_active", &ShmBackend::shm_active)
      .def_property_readonly("fallback_reason", &ShmBackend::fallback_reason)
      .def_property_readonly("gloo", &ShmBackend::gloo)
      .def("set_thread_policy", &ShmBackend::set_thread_policy, py::arg("spin_us"), py::arg("summation_threads"),
           "How long a wait spins before it sleeps (microseconds, 0: at once) and the most threads a reduction "
           "splits over (process-wide, 0: torch's count); before the first collective");
  m.def(
      "shm_backend_state",
      [](const c10::intrusive_ptr<c10d::Backend>& backend) -> py::object {
        const auto* shm = dynamic_cast<const ShmBackend*>(backend.get());
        if (shm == nullptr) return py::none();
        return py::make_tuple(shm->shm_active(), shm->fallback_reason(), shm->nodes());
      },
      py::arg("backend"),
      "(on one host's shared memory, why not, nodes the group runs across hierarchically or 0) of a 'fastpar' "
      "backend; None for any other backend");
  m.def(
      "shm_thread_policy",
      [](const c10::intrusive_ptr<c10d::Backend>& backend) -> py::object {
        const auto* shm = dynamic_cast<const ShmBackend*>(backend.get());
        if (shm == nullptr || !shm->shm_active()) return py::none();
        const auto [spin_us, threads] = shm->thread_policy();
        return py::make_tuple(spin_us, threads);
      },
      py::arg("backend"), "(spin_us, summation_threads) of a 'fastpar' backend on shared memory; else None");
  m.def(
      "shm_all_reduce_lists",
      [](const c10::intrusive_ptr<c10d::Backend>& backend, const py::list& lists) {
        auto* shm = dynamic_cast<ShmBackend*>(backend.get());
        TORCH_CHECK(shm != nullptr,
                    text("shm_all_reduce_lists needs a 'fastpar' backend, got ", backend->getBackendName()));
        // Straight from the Python objects: thousands of tensors cost no dispatcher boxing.
        std::vector<std::vector<at::Tensor>> tensors(lists.size());
        for (size_t k = 0; k < lists.size(); ++k) {
          const auto list = py::reinterpret_borrow<py::sequence>(lists[k]);
          tensors[k].reserve(list.size());
          for (const auto& item : list) {
            TORCH_CHECK_TYPE(THPVariable_Check(item.ptr()),
                             text("shm_all_reduce_lists: list ", k, " holds a non-tensor"));
            tensors[k].push_back(THPVariable_Unpack(item.ptr()));
          }
        }
        py::gil_scoped_release no_gil;
        shm->all_reduce_lists(tensors);
      },
      py::arg("backend"), py::arg("lists"),
      "All-reduce (SUM) each list of CPU tensors in place, one collective per list, all in flight before the first "
      "wait; returns when all are done");
  // The collective creation of a shared buffer, step by step (fastpar/comm/shared_buffers.py runs the steps and
  // agrees between them whether every rank succeeded).
  auto shared_of = [](const c10::intrusive_ptr<c10d::Backend>& backend) -> SharedBuffers& {
    auto* shm = dynamic_cast<ShmBackend*>(backend.get());
    TORCH_CHECK(shm != nullptr, text("shared buffers need a 'fastpar' backend, got ", backend->getBackendName()));
    return shm->shared_buffers();
  };
  m.def(
      "shm_shared_create",
      [shared_of](const c10::intrusive_ptr<c10d::Backend>& backend, int64_t bytes) {
        return shared_of(backend).create(static_cast<size_t>(bytes));
      },
      py::arg("backend"), py::arg("bytes"), "Step 1: create and map this rank's file; returns the buffer's id");
  m.def(
      "shm_shared_map_peers",
      [shared_of](const c10::intrusive_ptr<c10d::Backend>& backend, int64_t id) { shared_of(backend).map_peers(id); },
      py::arg("backend"), py::arg("id"), "Step 2: map the other ranks' files");
  m.def(
      "shm_shared_unlink",
      [shared_of](const c10::intrusive_ptr<c10d::Backend>& backend, int64_t id) { shared_of(backend).unlink_own(id); },
      py::arg("backend"), py::arg("id"), "Step 3: remove this rank's name (every rank mapped it)");
  m.def(
      "shm_shared_tensor",
      [shared_of](const c10::intrusive_ptr<c10d::Backend>& backend, int64_t id, at::ScalarType dtype,
                  int64_t numel) { return shared_of(backend).tensor(id, dtype, numel); },
      py::arg("backend"), py::arg("id"), py::arg("dtype"), py::arg("numel"),
      "Step 4: the flat tensor over this rank's buffer");
  m.def(
      "shm_mark_bucket_collective", [](bool active) { return BucketCollectiveScope::set(active); }, py::arg("active"),
      "On this thread, the all-reduces issued next are DDP's bucket collectives (the shared protocol); returns the "
      "previous value");
  m.def(
      "shm_shared_release",
      [shared_of](const c10::intrusive_ptr<c10d::Backend>& backend, int64_t id) { shared_of(backend).release(id); },
      py::arg("backend"), py::arg("id"), "Drop a buffer whose creation failed on some rank");
  m.def(
      "shm_all_reduce_runs",
      [](const c10::intrusive_ptr<c10d::Backend>& backend, const py::sequence& tensors) {
        auto* shm = dynamic_cast<ShmBackend*>(backend.get());
        TORCH_CHECK(shm != nullptr,
                    text("shm_all_reduce_runs needs a 'fastpar' backend, got ", backend->getBackendName()));
        // One list per run of one dtype, split here: the caller does no per-tensor Python work.
        std::vector<std::vector<at::Tensor>> lists;
        size_t i = 0;
        for (const auto& item : tensors) {
          TORCH_CHECK_TYPE(THPVariable_Check(item.ptr()),
                           text("all_reduce_coalesced: tensors[", i, "] is not a tensor"));
          const at::Tensor& t = THPVariable_Unpack(item.ptr());
          const auto dtype = t.scalar_type();
          TORCH_CHECK_TYPE(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16,
                           text("all_reduce_coalesced: tensors[", i, "] has dtype ", dtype,
                                "; use float32/float16/bfloat16"));
          if (lists.empty() || lists.back().front().scalar_type() != dtype) lists.emplace_back();
          lists.back().push_back(t);
          ++i;
        }
        py::gil_scoped_release no_gil;
        shm->all_reduce_lists(lists);
      },
      py::arg("backend"), py::arg("tensors"),
      "All-reduce (SUM) CPU tensors in place, one list collective per run of one dtype (float32/float16/"
      "bfloat16); returns when all are done");
  m.def("shm_create", &Segment::create, py::arg("name"), py::arg("world"), py::arg("slot_bytes"), py::arg("buffers"),
        py::arg("token"),
        "Create and initialise a group's segment in /dev/shm (mode 0600, pages reserved)");
  m.def("shm_unlink", &Segment::unlink, py::arg("name"), "Remove a segment's name (no error when it is gone)");
  m.def("shm_segment_bytes", &Segment::size_for, py::arg("world"), py::arg("slot_bytes"), py::arg("buffers"));
}

}  // namespace fastpar::shm
