// fastpar._C.BucketLauncher: DDP's per-gradient hot path (fastpar/ddp/reducer.py is the reducer; this is its engine for
// the common mode). One post hook on each parameter's AccumulateGrad node, registered here as torch's own reducer
// registers its hooks, so a gradient's arrival costs no Python call. While armed (one synchronised backward with
// an all-reduce per bucket), a hook marks its parameter ready, counts down its bucket, and launches every bucket
// that is complete, strictly in bucket order: stage the gradients into the bucket (the pack kernel of
// csrc/ops, or torch's own ops where fastpar.ddp.gradient_path uses them, with the same arithmetic) and start the
// all-reduce on the c10d ProcessGroup. Python hears once at the first gradient of a backward and once per launch
// (with the bucket's Work); everything else -- other modes, no_sync, errors -- runs the Python hook it calls when
// not armed. Device-agnostic: on CUDA the pack is queued on the current stream like fastpar.ops.pack.
#include <ATen/core/Tensor.h>
#include <ATen/ops/div.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/scalar_tensor.h>
#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/utils/pybind.h>

#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ops/bucket_ops.h"
#include "shm/shared_buffers.h"
#include "text.h"

namespace fastpar::ddp {
namespace {

using AccumulatorPtr = decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));

bool kernel_dtype(at::ScalarType t) { return t == at::kFloat || t == at::kHalf || t == at::kBFloat16; }

// A Python number as torch's Python bindings pass it to an op (a wrapped 0-d tensor), so every op here runs the
// kernel, and rounds, exactly as the same call from gradient_path.py does.
at::Tensor wrapped(const at::Scalar& value) {
  at::Tensor t = at::scalar_tensor(value, at::TensorOptions().dtype(value.isFloatingPoint() ? at::kDouble : at::kLong));
  t.unsafeGetTensorImpl()->set_wrapped_number(true);
  return t;
}

bool same_layout(const at::Tensor& a, const at::Tensor& b) {
  if (a.sizes() != b.sizes()) return false;
  for (int64_t d = 0; d < a.dim(); ++d) {
    if (a.size(d) != 1 && a.stride(d) != b.stride(d)) return false;
  }
  return true;
}

at::Tensor storage_flat(const at::Tensor& t) {
  if (t.is_contiguous()) return t.view({-1});
  return t.as_strided({t.numel()}, {1}, t.storage_offset());
}

struct Slot {
  at::Tensor param;
  at::Tensor grad_view;  // undefined without bucket views
  at::Tensor comm_view;
  int64_t bucket = -1;
  int64_t offset = 0;
  int64_t numel = 0;
  bool dense = true;
  bool param_contiguous = true;

  // ParamSlot.grad_in_storage_order: a 1-D storage-order view of `grad` when its layout matches the bucket's.
  std::optional<at::Tensor> in_storage_order(const at::Tensor& grad) const {
    if (grad.is_contiguous() && param_contiguous) return grad.view({-1});
    if (!dense) return grad.is_contiguous() ? std::optional<at::Tensor>(grad.view({-1})) : std::nullopt;
    if (!same_layout(grad, param)) return std::nullopt;
    return storage_flat(grad);
  }
};

// The message torch's C++ reducer gives when compiled autograd meets its hooks: the same cause, the same remedy.
constexpr const char* kCompiledAutogradHint =
    "Compiled autograd is not compatible with C++ DDP Reducer, please use "
    "torch._dynamo.config.optimize_ddp=\"python_reducer\".";

// Where one gradient became ready on a device with streams: autograd runs a node's backward (and the hook after
// AccumulateGrad) on the stream its forward ran on, so the gradients of one bucket may come from several streams.
// The launch reads them all from its own stream, so it waits for each one's event first (torch's reducer copies
// each gradient in its own hook instead). Python's twin: fastpar.ddp.ready_events.
class ReadyEvents {
 public:
  void resize(size_t n) {
    events_.resize(n);
    streams_.assign(n, std::nullopt);
  }
  void clear() { std::fill(streams_.begin(), streams_.end(), std::nullopt); }

  // On the stream that produced gradient `index` (the hook's current stream), after anything the hook queued.
  void record(size_t index, const at::Device& device) {
    c10::impl::VirtualGuardImpl impl(device.type());
    const c10::Stream stream = impl.getStream(device);
    if (!events_[index]) events_[index] = std::make_unique<c10::Event>(device.type());
    events_[index]->record(stream);
    streams_[index] = stream;
  }

  // Before the launch on the current stream reads gradient `index`: order it after its producer's stream, and tell
  // the caching allocator that the current stream uses `grad` (freed once .grad becomes the bucket view).
  void wait(size_t index, const at::Device& device, const at::Tensor& grad) const {
    if (!streams_[index]) return;
    c10::impl::VirtualGuardImpl impl(device.type());
    const c10::Stream current = impl.getStream(device);
    if (*streams_[index] == current) return;  // one stream: already in order
    events_[index]->block(current);
    if (grad.defined() && grad.has_storage()) impl.recordDataPtrOnStream(grad.storage().data_ptr(), current);
  }

 private:
  std::vector<std::unique_ptr<c10::Event>> events_;
  std::vector<std::optional<c10::Stream>> streams_;
};

struct Bucket {
  at::Tensor comm_flat;
  at::Tensor grad_flat;  // undefined without bucket views
  std::vector<int64_t> slots;
  int64_t pending = 0;
};

// Copies into one bucket's buffer, collected and then run as one kernel call (gradient_path._pack).
class Packer {
 public:
  Packer(const at::Tensor& flat, double scale) : flat_(flat), scale_(scale) {}
  void add(const at::Tensor& source, const Slot& slot) {
    kernel_ok_ = kernel_ok_ && kernel_dtype(source.scalar_type());
    sources_.emplace_back(source, slot.offset);
  }
  void run() {
    if (sources_.empty()) return;
    if (!kernel_ok_ || !kernel_dtype(flat_.scalar_type())) {  // float64 and others: torch's mul, as torch's reducer
      for (auto& [src, offset] : sources_) {
        at::Tensor region = flat_.narrow(0, offset, src.numel());
        at::mul_out(region, src, wrapped(scale_));
      }
      return;
    }
    const auto scale = static_cast<float>(scale_);
    std::vector<CopySpan> spans;
    spans.reserve(sources_.size());
    char* base = static_cast<char*>(flat_.data_ptr());
    const int64_t step = flat_.element_size();
    for (auto& [src, offset] : sources_) {
      const at::Tensor& s = src.is_contiguous() ? src : keep_.emplace_back(src.contiguous());
      spans.push_back({s.const_data_ptr(), base + offset * step, s.numel(), s.scalar_type(), flat_.scalar_type()});
    }
#ifdef FASTPAR_WITH_CUDA
    if (flat_.is_cuda()) return scaled_copy_cuda(spans, scale, false, flat_.device());
#endif
    TORCH_CHECK(flat_.is_cpu(), text("fastpar DDP: the extension's gradient path has no kernels for ", flat_.device()));
    scaled_copy_cpu(spans, scale, false);
  }

 private:
  at::Tensor flat_;
  double scale_;
  std::vector<std::pair<at::Tensor, int64_t>> sources_;
  std::vector<at::Tensor> keep_;
  bool kernel_ok_ = true;
};

class BucketLauncher {
 public:
  BucketLauncher(const std::vector<at::Tensor>& params, const c10::intrusive_ptr<c10d::ProcessGroup>& group,
            py::object on_grad, py::object on_start, py::object on_launched, py::object on_twice,
            py::object on_launch_failed)
      : group_(group),
        on_grad_(std::move(on_grad)),
        on_start_(std::move(on_start)),
        on_launched_(std::move(on_launched)),
        on_twice_(std::move(on_twice)),
        on_launch_failed_(std::move(on_launch_failed)) {
    slots_.resize(params.size());
    fires_.assign(params.size(), 0);
    staged_.assign(params.size(), false);
    streams_ = !params.empty() && params[0].device().type() != c10::DeviceType::CPU;
    if (streams_) ready_events_.resize(params.size());
    for (size_t i = 0; i < params.size(); ++i) {
      TORCH_CHECK_VALUE(params[i].requires_grad() && params[i].is_leaf(), text("fastpar DDP: parameter ", i,
                        " is not a leaf that requires grad"));
      slots_[i].param = params[i];
      auto acc = torch::autograd::impl::grad_accumulator(params[i]);
      hooks_.emplace_back(acc, acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
                                   [this, i](const torch::autograd::variable_list& outputs,
                                             const torch::autograd::variable_list& /*inputs*/) {
                                     on_hook(i);
                                     return outputs;
                                   },
                                   [](torch::autograd::CompiledNodeArgs& /*args*/) {
                                     // torch's own reducer answers compiled autograd with this hint
                                     TORCH_CHECK(false, kCompiledAutogradHint);
                                   })));
    }
  }

  ~BucketLauncher() { remove_hooks(); }

  // buckets: [(comm_flat, grad_flat | None, [(slot index, offset, grad_view | None, comm_view, dense), ...]), ...]
  void set_layout(const py::list& buckets) {
    std::vector<Bucket> layout;
    std::vector<Slot> slots = slots_;  // filled here, swapped in under the mutex
    for (Slot& s : slots) {  // nothing of the last layout stays referenced (an empty list releases it all)
      s.grad_view = s.comm_view = at::Tensor();
      s.bucket = -1;
    }
    for (const auto& item : buckets) {
      auto entry = item.cast<py::tuple>();
      Bucket b;
      b.comm_flat = entry[0].cast<at::Tensor>();
      if (!entry[1].is_none()) b.grad_flat = entry[1].cast<at::Tensor>();
      for (const auto& member : entry[2].cast<py::list>()) {
        auto m = member.cast<py::tuple>();
        const auto index = m[0].cast<int64_t>();
        TORCH_CHECK_INDEX(index >= 0 && index < static_cast<int64_t>(slots.size()), text("fastpar DDP: slot ", index,
                          " out of range"));
        Slot& s = slots[index];
        s.bucket = static_cast<int64_t>(layout.size());
        s.offset = m[1].cast<int64_t>();
        s.grad_view = m[2].is_none() ? at::Tensor() : m[2].cast<at::Tensor>();
        s.comm_view = m[3].cast<at::Tensor>();
        s.dense = m[4].cast<bool>();
        s.numel = s.param.numel();
        s.param_contiguous = s.param.is_contiguous();
        b.slots.push_back(index);
      }
      layout.push_back(std::move(b));
    }
    py::gil_scoped_release no_gil;  // a hook may hold the mutex while its collective needs the GIL
    std::lock_guard<std::mutex> lock(mutex_);
    buckets_ = std::move(layout);
    slots_ = std::move(slots);
    armed_ = false;
  }

  // The coming backward runs here: gradients times `scale`; `alias_divisor` > 0 divides gradients that already
  // are their bucket view by it instead (torch's gradient_as_bucket_view=True); gradients of at least
  // `arrival_min` elements (>= 0) are staged as they arrive.
  void arm(double scale, int64_t alias_divisor, int64_t arrival_min) {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(!buckets_.empty(), "fastpar DDP: BucketLauncher.arm before set_layout");
    reset_locked();
    scale_ = scale;
    alias_divisor_ = alias_divisor;
    arrival_min_ = arrival_min;
    armed_ = true;
  }

  void disarm() {
    std::lock_guard<std::mutex> lock(mutex_);
    reset_locked();
    armed_ = false;
  }

  // A nested backward ended before the outer one: the next gradient tells Python again (it re-queues its check).
  void expect_start() {
    std::lock_guard<std::mutex> lock(mutex_);
    need_start_ = true;
  }

  // The order in which gradients arrived in this backward (slot indices): torch's rebuild and its logger read it.
  std::vector<int64_t> arrival_order() {
    std::lock_guard<std::mutex> lock(mutex_);
    return arrival_;
  }

  // (slot indices that arrived, slot indices staged on arrival) of the running backward, for error reports.
  std::pair<std::vector<int64_t>, std::vector<int64_t>> progress() {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<int64_t> arrived, staged;
    for (size_t i = 0; i < slots_.size(); ++i) {
      if (fires_[i] > 0) arrived.push_back(static_cast<int64_t>(i));
      if (staged_[i]) staged.push_back(static_cast<int64_t>(i));
    }
    return {arrived, staged};
  }

  void remove_hooks() {
    for (auto& [acc, key] : hooks_) acc->del_post_hook(key);
    hooks_.clear();
  }

 private:
  void reset_locked() {
    std::fill(fires_.begin(), fires_.end(), 0);
    std::fill(staged_.begin(), staged_.end(), false);
    for (auto& b : buckets_) b.pending = static_cast<int64_t>(b.slots.size());
    arrival_.clear();
    arrival_.reserve(slots_.size());
    next_ = 0;
    need_start_ = true;
    if (streams_) ready_events_.clear();
  }

  // Runs on autograd's thread for this device, without the GIL.
  void on_hook(size_t index) {
    bool armed = false, start = false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      armed = armed_;
      start = armed && need_start_;
    }
    // Python is only ever called with the mutex released: it may disarm (an error ends the backward).
    if (!armed) return call_python(on_grad_, index);  // the Python hook: the other modes, no_sync
    if (start) {
      // Python's start is idempotent; the flag is cleared only once it has run, so a hook on another device's
      // thread that arrives meanwhile calls it too instead of running ahead of the bookkeeping it sets up.
      call_python(on_start_);  // starts the backward's bookkeeping (end-of-backward check) in Python
      std::lock_guard<std::mutex> lock(mutex_);
      need_start_ = false;
    }
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    int64_t first = -1, failed = -1;
    std::string failure;
    bool twice = false;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      if (!armed_) {  // the start disarmed it
        lock.unlock();
        return call_python(on_grad_, index);
      }
      if (++fires_[index] > 1) {
        twice = true;
      } else {
        arrival_.push_back(static_cast<int64_t>(index));
        Slot& slot = slots_[index];
        if (arrival_min_ >= 0 && slot.numel >= arrival_min_) stage_on_arrival(slot, index);
        if (streams_) ready_events_.record(index, slot.param.device());  // after the staging it queued
        if (--buckets_[slot.bucket].pending == 0 && slot.bucket == next_) {
          first = next_;
          while (next_ < static_cast<int64_t>(buckets_.size()) && buckets_[next_].pending == 0) {
            try {
              works.push_back(launch(buckets_[next_]));
            } catch (const std::exception& e) {  // the collectives already issued still go to Python, below
              failed = next_;
              failure = e.what();
              break;
            }
            ++next_;
          }
        }
      }
    }
    if (twice) call_python(on_twice_, index);  // raises: a parameter received two gradients
    if (!works.empty()) {
      pybind11::gil_scoped_acquire gil;
      py::list handles;
      for (auto& w : works) handles.append(py::cast(w));
      call_locked_gil(on_launched_, first, handles);
    }
    // Python waits for what went out, ends the backward and raises this cause (not, later, a confusing one).
    if (failed >= 0) call_python(on_launch_failed_, failed, failure);
  }

  void stage_on_arrival(Slot& slot, size_t index) {
    const at::Tensor grad = slot.param.grad();
    if (!grad.defined() || is_view(grad, slot)) return;
    Bucket& b = buckets_[slot.bucket];
    at::NoGradGuard no_grad;
    Packer packer(b.comm_flat, scale_);
    stage_fresh(slot, grad, packer);
    packer.run();
    staged_[index] = true;
  }

  static bool is_view(const at::Tensor& grad, const Slot& slot) {
    return slot.grad_view.defined() && grad.unsafeGetTensorImpl() == slot.grad_view.unsafeGetTensorImpl();
  }

  // A gradient autograd allocated: copied into the bucket (through `packer`, or strided here); in view mode
  // `.grad` becomes its bucket view.
  void stage_fresh(Slot& slot, const at::Tensor& grad, Packer& packer) {
    auto source = slot.in_storage_order(grad);
    if (slot.grad_view.defined()) slot.param.mutable_grad() = slot.grad_view;
    if (!source) {  // strides break the layout contract: let torch map them
      at::Tensor& out = slot.comm_view;
      at::mul_out(out, grad, wrapped(scale_));
      return;
    }
    packer.add(*source, slot);
  }

  // gradient_path.stage for a bucket of an all-reduce without comm hook, nothing unused.
  c10::intrusive_ptr<c10d::Work> launch(Bucket& b) {
    at::NoGradGuard no_grad;
    const bool in_place = b.grad_flat.defined() && b.comm_flat.is_same(b.grad_flat);
    if (streams_) {
      for (int64_t index : b.slots) ready_events_.wait(index, b.comm_flat.device(), slots_[index].param.grad());
    }
    Packer packer(b.comm_flat, scale_);
    int64_t run_start = -1, run_end = -1;  // consecutive gradients already in place: one mul_/div_
    auto flush_in_place = [&]() {
      if (run_start < 0) return;
      at::Tensor region = b.comm_flat.narrow(0, run_start, run_end - run_start);
      if (alias_divisor_ > 0) {
        region.div_(wrapped(alias_divisor_));
      } else if (scale_ != 1.0) {
        region.mul_(wrapped(scale_));
      }
      run_start = run_end = -1;
    };
    for (int64_t index : b.slots) {
      if (staged_[index]) continue;
      Slot& slot = slots_[index];
      const at::Tensor grad = slot.param.grad();
      if (!grad.defined()) {
        b.comm_flat.narrow(0, slot.offset, slot.numel).zero_();
        continue;
      }
      if (is_view(grad, slot)) {
        if (in_place) {
          if (run_start >= 0 && run_end != slot.offset) flush_in_place();
          if (run_start < 0) run_start = slot.offset;
          run_end = slot.offset + slot.numel;
          continue;
        }
        at::Tensor from = b.grad_flat.narrow(0, slot.offset, slot.numel);
        if (alias_divisor_ > 0) {  // separate buffer: divide on the way across
          at::Tensor to = b.comm_flat.narrow(0, slot.offset, slot.numel);
          at::div_out(to, from, wrapped(alias_divisor_));
          continue;
        }
        packer.add(from, slot);
        continue;
      }
      stage_fresh(slot, grad, packer);
    }
    packer.run();
    flush_in_place();
    c10d::AllreduceOptions opts;
    opts.reduceOp = c10d::ReduceOp::SUM;
    std::vector<at::Tensor> tensors{b.comm_flat};
    fastpar::shm::BucketCollectiveScope bucket_collective;  // a bucket in shared memory takes the shared protocol
    return group_->allreduce(tensors, opts);
  }

  template <typename... Args>
  static void call_python(const py::object& fn, Args&&... args) {
    pybind11::gil_scoped_acquire gil;
    call_locked_gil(fn, std::forward<Args>(args)...);
  }

  // A Python exception travels through autograd as Python's own hooks' do (the engine restores it).
  template <typename... Args>
  static void call_locked_gil(const py::object& fn, Args&&... args) {
    try {
      fn(std::forward<Args>(args)...);
    } catch (py::error_already_set& e) {
      e.restore();
      throw python_error();
    }
  }

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  py::object on_grad_, on_start_, on_launched_, on_twice_, on_launch_failed_;
  std::vector<Slot> slots_;
  std::vector<Bucket> buckets_;
  std::vector<std::pair<AccumulatorPtr, uintptr_t>> hooks_;
  std::mutex mutex_;
  // per backward
  std::vector<int> fires_;
  std::vector<bool> staged_;
  std::vector<int64_t> arrival_;
  int64_t next_ = 0;
  bool armed_ = false;
  bool need_start_ = true;
  bool streams_ = false;  // the parameters' device orders work by streams (not the CPU)
  ReadyEvents ready_events_;
  double scale_ = 1.0;
  int64_t alias_divisor_ = 0;
  int64_t arrival_min_ = -1;
};

}  // namespace

void bind(py::module_& m) {
  py::class_<BucketLauncher>(m, "BucketLauncher",
                        "DDP's per-gradient hot path: AccumulateGrad post hooks, bucket bookkeeping and launches")
      .def(py::init<const std::vector<at::Tensor>&, const c10::intrusive_ptr<c10d::ProcessGroup>&, py::object,
                    py::object, py::object, py::object, py::object>(),
           py::arg("params"), py::arg("group"), py::arg("on_grad"), py::arg("on_start"), py::arg("on_launched"),
           py::arg("on_twice"), py::arg("on_launch_failed"))
      .def("set_layout", &BucketLauncher::set_layout, py::arg("buckets"))
      .def("arm", &BucketLauncher::arm, py::arg("scale"), py::arg("alias_divisor"), py::arg("arrival_min"),
           py::call_guard<py::gil_scoped_release>())
      .def("disarm", &BucketLauncher::disarm, py::call_guard<py::gil_scoped_release>())
      .def("expect_start", &BucketLauncher::expect_start, py::call_guard<py::gil_scoped_release>())
      .def("arrival_order", &BucketLauncher::arrival_order, py::call_guard<py::gil_scoped_release>())
      .def("progress", &BucketLauncher::progress, py::call_guard<py::gil_scoped_release>())
      .def("remove_hooks", &BucketLauncher::remove_hooks);
}

}  // namespace fastpar::ddp
