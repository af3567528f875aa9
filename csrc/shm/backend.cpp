// The "fastpar" c10d backend: picks, per call, the shared-memory collective or gloo.
#include "shm/backend.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <utility>

#include "shm/collectives.h"
#include "shm/dense.h"
#include "shm/reduce.h"
#include "text.h"

namespace fastpar::shm {
namespace {

using c10d::OpType;

// The gather side of _allgather_base / all_gather_into_tensor: rank q's share of `out`.
void gather_into(Group& g, const Dense& in, const Dense& out, std::chrono::milliseconds timeout) {
  std::vector<void*> shares(g.world());
  for (int q = 0; q < g.world(); ++q) shares[q] = out.ptr() + q * in.bytes();
  all_gather(g, in.ptr(), shares, in.bytes(), in.dtype(), timeout);
  out.write_back();
}

// reduce_scatter_tensor: gloo all-reduces the whole input and keeps share `rank`, so the sums follow the order of
// an all-reduce over world * count elements, in the input's storage order.
void reduce_scatter_tensor(Group& g, const Dense& in, const Dense& out, Reduction reduction,
                           std::chrono::milliseconds timeout) {
  const int64_t count = out.numel();
  if (in.reordered) {
    // Share `rank` is a logical slice, scattered over the storage: all-reduce a copy laid out like the input and
    // take the slice from it (a rare layout; twice the traffic of the reduce-scatter below).
    at::Tensor sums = at::empty_strided(in.user.sizes(), in.user.strides(), in.user.options());
    at::Tensor flat = sums.as_strided({sums.numel()}, {1});
    flat.copy_(in.data);
    all_reduce(g, flat.data_ptr(), flat.numel(), reduction, timeout);
    out.user.copy_(sums.reshape(-1).narrow(0, g.rank() * count, count).view(out.user.sizes()));
    return;
  }
  std::vector<const void*> parts(g.world());
  std::vector<int64_t> offsets(g.world());
  for (int q = 0; q < g.world(); ++q) {
    parts[q] = in.ptr() + q * out.bytes();
    offsets[q] = q * count;
  }
  reduce_scatter(g, parts, out.ptr(), count, count * g.world(), offsets, reduction, timeout);
  out.write_back();
}

}  // namespace

ShmBackend::ShmBackend(int rank, int size, c10::intrusive_ptr<c10d::Backend> gloo, std::chrono::milliseconds timeout)
    : c10d::Backend(rank, size),
      gloo_(std::move(gloo)),
      options_(c10::make_intrusive<Options>("fastpar", timeout)),
      reason_("not attached to a shared-memory segment") {
  TORCH_CHECK(gloo_, "fastpar shm backend needs a gloo backend to delegate to");
  init();
}

ShmBackend::~ShmBackend() {
  if (executor_) executor_->shutdown();
}

std::string ShmBackend::attach(const std::string& name, uint64_t token) {
  try {
    auto group = std::make_unique<Group>(Segment::open(name, size_, token), rank_, options_->timeout);
    auto executor = std::make_shared<Executor>(std::move(group));
    executor->start();
    executor_ = std::move(executor);
    shared_ = std::make_unique<SharedBuffers>(name, rank_, size_);
    reason_.clear();
  } catch (const std::exception& e) {
    reason_ = message_of(e);
  }
  return reason_;
}

void ShmBackend::detach(const std::string& reason) {
  if (executor_) executor_->shutdown();
  executor_.reset();
  layout_.reset();
  shared_.reset();  // buffers already made stay mapped as long as their tensors; their all-reduces go to gloo
  reason_ = reason;
}

SharedBuffers& ShmBackend::shared_buffers() {
  TORCH_CHECK(shared_ != nullptr,
              text("fastpar shm backend: shared buffers need the shared-memory path (", reason_, ")"));
  return *shared_;
}

void ShmBackend::set_thread_policy(int64_t spin_us, int summation_threads) {
  if (executor_) executor_->group().set_max_spin(std::chrono::microseconds(std::max<int64_t>(0, spin_us)));
  set_summation_threads(summation_threads);
}

std::tuple<int64_t, int> ShmBackend::thread_policy() const {
  const int64_t spin_us =
      executor_ ? std::chrono::duration_cast<std::chrono::microseconds>(executor_->group().max_spin()).count() : 0;
  return {spin_us, summation_threads()};
}

void ShmBackend::setTimeout(std::chrono::milliseconds timeout) {
  options_->timeout = timeout;
  if (executor_) executor_->group().set_default_timeout(timeout);
  try {
    gloo_->setTimeout(timeout);
  } catch (const std::exception&) {  // a gloo without setTimeout keeps its own
  }
}

c10d::ErrorType ShmBackend::getError() {
  return executor_ && executor_->group().aborted() ? c10d::ErrorType::COMM_ERROR : c10d::ErrorType::SUCCESS;
}

void ShmBackend::abort() {
  if (executor_) executor_->abort("rank " + std::to_string(rank_) + " aborted the process group");
  if (layout_ && layout_->leaders) layout_->leaders->abort();
  gloo_->abort();
}

void ShmBackend::shutdown() {
  if (executor_) executor_->shutdown();
  if (layout_ && layout_->leaders) layout_->leaders->shutdown();
  gloo_->shutdown();
}

std::chrono::milliseconds ShmBackend::op_timeout(std::chrono::milliseconds requested) const {
  return requested == c10d::kUnsetTimeout ? std::chrono::milliseconds(0) : requested;
}

c10::intrusive_ptr<c10d::Work> ShmBackend::enqueue(OpType type, const char* title, std::vector<at::Tensor> outputs,
                                                   ShmWork::Body body) {
  ++seq_;
  auto work = c10::make_intrusive<ShmWork>(rank_, type, title, std::move(outputs), std::move(body), executor_);
  executor_->submit(work);
  return work;
}

c10::intrusive_ptr<c10d::Work> ShmBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceOptions& opts) {
  if (!executor_ || tensors.size() != 1 || !reducible_tensor(tensors[0]) || !sum_or_avg(opts.reduceOp)) {
    return gloo_->allreduce(tensors, opts);
  }
  if (across_nodes()) {
    return nodes_all_reduce(tensors, opts.reduceOp, op_timeout(opts.timeout), OpType::ALLREDUCE, "fastpar:all_reduce");
  }
  const auto timeout = op_timeout(opts.timeout);
  const at::Tensor& user = tensors[0];
  int64_t offset = 0;
  if (BucketCollectiveScope::active() && user.is_contiguous() && !user.is_complex()) {  // DDP marked its bucket
    const auto bytes = static_cast<size_t>(user.numel()) * user.element_size();
    if (auto region = shared_->find(user.const_data_ptr(), bytes, &offset)) {  // a DDP bucket: nothing to stage
      const Reduction reduction{user.scalar_type(), opts.reduceOp.op_ == c10d::ReduceOp::AVG};
      const int64_t numel = user.numel();
      return enqueue(OpType::ALLREDUCE, "fastpar:all_reduce", tensors,
                     [region, offset, numel, reduction, timeout](Group& g) {
                       std::vector<char*> bases(region->bases.size());
                       for (size_t q = 0; q < bases.size(); ++q) bases[q] = region->bases[q] + offset;
                       shm::all_reduce_shared(g, bases, numel, reduction, region->id, offset, timeout);
                     });
    }
  }
  const Dense t(tensors[0], Order::kStorage);
  const Reduction reduction = reduction_of(t, opts.reduceOp);
  return enqueue(OpType::ALLREDUCE, "fastpar:all_reduce", tensors, [t, reduction, timeout](Group& g) {
    shm::all_reduce(g, t.ptr(), t.numel(), reduction, timeout);
    t.write_back();
  });
}

c10::intrusive_ptr<c10d::Work> ShmBackend::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                               const c10d::AllreduceCoalescedOptions& opts) {
  bool handled = executor_ && !tensors.empty() && sum_or_avg(opts.reduceOp);
  for (const auto& t : tensors) handled = handled && reducible_tensor(t) && same_dtype(t, tensors[0]);
  if (!handled) return gloo_->allreduce_coalesced(tensors, opts);
  if (across_nodes()) {
    return nodes_all_reduce(tensors, opts.reduceOp, op_timeout(opts.timeout), OpType::ALLREDUCE_COALESCED,
                            "fastpar:all_reduce_coalesced");
  }
  const Reduction reduction{real_dtype(tensors[0]), opts.reduceOp.op_ == c10d::ReduceOp::AVG};
  auto work = list_work(tensors, reduction, op_timeout(opts.timeout), OpType::ALLREDUCE_COALESCED,
                        "fastpar:all_reduce_coalesced", tensors);
  executor_->submit(work);
  return work;
}

// As gloo: one all-reduce of the tensors' concatenation (each in logical order: gloo flattens them), here without
// the flat copy: every tensor is staged from and summed into where it lies. A contiguous real tensor is used as it
// is (the caller or the Work holds it); only the others take a Dense (a detached view or a copy).
c10::intrusive_ptr<ShmWork> ShmBackend::list_work(const std::vector<at::Tensor>& tensors, Reduction reduction,
                                                   std::chrono::milliseconds timeout, OpType type, const char* title,
                                                   std::vector<at::Tensor> outputs) {
  std::vector<Span> spans;
  std::vector<Dense> copies;
  spans.reserve(tensors.size());
  for (const auto& t : tensors) {
    if (t.is_contiguous() && !t.is_complex()) {
      spans.push_back({static_cast<char*>(t.data_ptr()), t.numel()});
    } else {
      copies.emplace_back(t);
      spans.push_back({copies.back().ptr(), copies.back().numel()});
    }
  }
  ++seq_;
  return c10::make_intrusive<ShmWork>(
      rank_, type, title, std::move(outputs),
      [spans = std::move(spans), copies = std::move(copies), reduction, timeout](Group& g) {
        all_reduce(g, spans, reduction, timeout);
        for (const auto& t : copies) t.write_back();
      },
      executor_);
}

void ShmBackend::all_reduce_lists(const std::vector<std::vector<at::Tensor>>& lists) {
  TORCH_CHECK(flat(),
              text("fastpar shm backend: all_reduce_lists needs the shared-memory path, which is off: ", reason_));
  for (size_t k = 0; k < lists.size(); ++k) {
    const auto& list = lists[k];
    for (size_t i = 0; i < list.size(); ++i) {
      TORCH_CHECK(reducible_tensor(list[i]) && same_dtype(list[i], list[0]),
                  text("fastpar shm backend: list ", k, ", tensor ", i, " is ", list[i].scalar_type(), " on ",
                       list[i].device(), "; a list all-reduce takes CPU tensors of one float dtype (",
                       list[0].scalar_type(), " here)"));
    }
  }
  // The caller waits at once: each list runs on this thread when the queue is empty, without waking the worker.
  for (const auto& list : lists) {
    if (list.empty()) continue;
    auto work = list_work(list, Reduction{real_dtype(list[0]), false}, op_timeout(c10d::kUnsetTimeout),
                          OpType::ALLREDUCE_COALESCED, "fastpar:all_reduce_list", {});
    executor_->run_now(work);
    work->wait(kNoTimeout);  // completed by now: rethrows its failure
  }
}

c10::intrusive_ptr<c10d::Work> ShmBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                     const c10d::BroadcastOptions& opts) {
  if (!executor_ || tensors.size() != 1 || !on_cpu(tensors[0]) || opts.rootTensor != 0 || opts.rootRank < 0 ||
      opts.rootRank >= size_) {
    return gloo_->broadcast(tensors, opts);
  }
  if (across_nodes()) return nodes_broadcast(tensors, static_cast<int>(opts.rootRank), op_timeout(opts.timeout));
  const Dense t(tensors[0]);
  const int root = static_cast<int>(opts.rootRank);
  const auto timeout = op_timeout(opts.timeout);
  return enqueue(OpType::BROADCAST, "fastpar:broadcast", tensors, [t, root, timeout](Group& g) {
    shm::broadcast(g, t.ptr(), t.bytes(), root, t.dtype(), timeout);
    if (g.rank() != root) t.write_back();
  });
}

c10::intrusive_ptr<c10d::Work> ShmBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) {
  bool handled = flat() && inputs.size() == 1 && outputs.size() == 1 &&
                 outputs[0].size() == static_cast<size_t>(size_) && on_cpu(inputs[0]);
  for (size_t q = 0; handled && q < outputs[0].size(); ++q) {
    const auto& out = outputs[0][q];
    handled = on_cpu(out) && same_dtype(out, inputs[0]) && out.numel() == inputs[0].numel();
  }
  if (!handled) return gloo_->allgather(outputs, inputs, opts);
  const Dense in(inputs[0]);
  const std::vector<Dense> outs = dense_all(outputs[0]);
  const auto timeout = op_timeout(opts.timeout);
  return enqueue(OpType::ALLGATHER, "fastpar:all_gather", outputs[0], [in, outs, timeout](Group& g) {
    std::vector<void*> shares;
    for (const auto& out : outs) shares.push_back(out.ptr());
    all_gather(g, in.ptr(), shares, in.bytes(), in.dtype(), timeout);
    for (const auto& out : outs) out.write_back();
  });
}

c10::intrusive_ptr<c10d::Work> ShmBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                           const c10d::AllgatherOptions& opts) {
  std::vector<at::Tensor> outputs{output};
  std::vector<at::Tensor> inputs{input};
  return allgather_into_tensor_coalesced(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> ShmBackend::allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                           std::vector<at::Tensor>& inputs,
                                                                           const c10d::AllgatherOptions& opts) {
  if (!executor_ || !world_pairs(outputs, inputs, size_) || (across_nodes() && !layout_->uniform)) {
    if (outputs.size() == 1 && inputs.size() == 1) return gloo_->_allgather_base(outputs[0], inputs[0], opts);
    return gloo_->allgather_into_tensor_coalesced(outputs, inputs, opts);
  }
  if (across_nodes()) return nodes_all_gather(outputs, inputs, op_timeout(opts.timeout));
  const std::vector<Dense> ins = dense_all(inputs);
  const std::vector<Dense> outs = dense_all(outputs);
  const auto timeout = op_timeout(opts.timeout);
  return enqueue(OpType::_ALLGATHER_BASE, "fastpar:all_gather_into_tensor", outputs, [ins, outs, timeout](Group& g) {
    for (size_t i = 0; i < ins.size(); ++i) gather_into(g, ins[i], outs[i], timeout);
  });
}

c10::intrusive_ptr<c10d::Work> ShmBackend::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                          std::vector<std::vector<at::Tensor>>& inputs,
                                                          const c10d::ReduceScatterOptions& opts) {
  bool handled = flat() && outputs.size() == 1 && inputs.size() == 1 &&
                 inputs[0].size() == static_cast<size_t>(size_) && reducible_tensor(outputs[0]) &&
                 sum_or_avg(opts.reduceOp);
  for (size_t q = 0; handled && q < inputs[0].size(); ++q) {
    const auto& part = inputs[0][q];
    handled = on_cpu(part) && same_dtype(part, outputs[0]) && part.numel() == outputs[0].numel();
  }
  if (!handled) return gloo_->reduce_scatter(outputs, inputs, opts);
  // gloo all-reduces each part on its own, in the part's storage order; the sums come out in that order too.
  const std::vector<Dense> parts = dense_all(inputs[0], Order::kStorage);
  const Dense& mine = parts[rank_];
  const at::Tensor out = outputs[0].is_complex() ? at::view_as_real(outputs[0].detach()) : outputs[0].detach();
  const bool direct =
      !mine.reordered || (out.sizes() == mine.user.sizes() && out.strides() == mine.user.strides());
  const Dense sums(direct ? out : at::empty_strided(mine.user.sizes(), mine.user.strides(), mine.user.options()),
                   mine.reordered ? Order::kStorage : Order::kLogical);
  const Reduction reduction = reduction_of(sums, opts.reduceOp);
  const auto timeout = op_timeout(opts.timeout);
  return enqueue(OpType::REDUCE_SCATTER, "fastpar:reduce_scatter", outputs,
                 [out, sums, parts, direct, reduction, timeout](Group& g) {
                   // every part is an all-reduce of `count` elements from offset 0
                   std::vector<const void*> sources;
                   for (const auto& part : parts) sources.push_back(part.ptr());
                   const std::vector<int64_t> offsets(g.world(), 0);
                   shm::reduce_scatter(g, sources, sums.ptr(), sums.numel(), sums.numel(), offsets, reduction,
                                       timeout);
                   sums.write_back();
                   if (!direct) out.copy_(sums.user.reshape(out.sizes()));
                 });
}

c10::intrusive_ptr<c10d::Work> ShmBackend::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                const c10d::ReduceScatterOptions& opts) {
  std::vector<at::Tensor> outputs{output};
  std::vector<at::Tensor> inputs{input};
  return reduce_scatter_tensor_coalesced(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> ShmBackend::reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                           std::vector<at::Tensor>& inputs,
                                                                           const c10d::ReduceScatterOptions& opts) {
  bool handled = executor_ && sum_or_avg(opts.reduceOp) && world_pairs(inputs, outputs, size_);
  for (size_t i = 0; handled && i < inputs.size(); ++i) handled = reducible_tensor(inputs[i]);
  if (!handled) {
    if (outputs.size() == 1 && inputs.size() == 1) return gloo_->_reduce_scatter_base(outputs[0], inputs[0], opts);
    return gloo_->reduce_scatter_tensor_coalesced(outputs, inputs, opts);
  }
  if (across_nodes()) return nodes_reduce_scatter(outputs, inputs, opts.reduceOp, op_timeout(opts.timeout));
  const std::vector<Dense> ins = dense_all(inputs, Order::kStorage);
  const std::vector<Dense> outs = dense_all(outputs);
  const c10d::ReduceOp op = opts.reduceOp;
  const auto timeout = op_timeout(opts.timeout);
  return enqueue(OpType::_REDUCE_SCATTER_BASE, "fastpar:reduce_scatter_tensor", outputs,
                 [ins, outs, op, timeout](Group& g) {
                   for (size_t i = 0; i < ins.size(); ++i) {
                     reduce_scatter_tensor(g, ins[i], outs[i], reduction_of(outs[i], op), timeout);
                   }
                 });
}

c10::intrusive_ptr<c10d::Work> ShmBackend::barrier(const c10d::BarrierOptions& opts) {
  if (!executor_) return gloo_->barrier(opts);
  if (across_nodes()) return nodes_barrier(op_timeout(opts.timeout));
  const auto timeout = op_timeout(opts.timeout);
  return enqueue(OpType::BARRIER, "fastpar:barrier", {}, [timeout](Group& g) { shm::barrier(g, timeout); });
}

}  // namespace fastpar::shm
