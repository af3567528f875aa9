// The calls the "fastpar" backend hands to its gloo backend unchanged: what shared memory does not do (reduce,
// gather, scatter, all-to-all, point-to-point, sparse, monitored barriers).
#include "shm/backend.h"

namespace fastpar::shm {

c10::intrusive_ptr<c10d::Work> ShmBackend::allreduce_sparse(std::vector<at::Tensor>& tensors,
                                                            const c10d::AllreduceOptions& opts) {
  return gloo_->allreduce_sparse(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> ShmBackend::reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) {
  return gloo_->reduce(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> ShmBackend::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                               std::vector<at::Tensor>& inputs,
                                                               const c10d::AllgatherOptions& opts) {
  return gloo_->allgather_coalesced(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> ShmBackend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                  std::vector<at::Tensor>& inputs, const c10d::GatherOptions& opts) {
  return gloo_->gather(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> ShmBackend::scatter(std::vector<at::Tensor>& outputs,
                                                   std::vector<std::vector<at::Tensor>>& inputs,
                                                   const c10d::ScatterOptions& opts) {
  return gloo_->scatter(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> ShmBackend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                         std::vector<int64_t>& output_split_sizes,
                                                         std::vector<int64_t>& input_split_sizes,
                                                         const c10d::AllToAllOptions& opts) {
  return gloo_->alltoall_base(output, input, output_split_sizes, input_split_sizes, opts);
}

c10::intrusive_ptr<c10d::Work> ShmBackend::alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                                    const c10d::AllToAllOptions& opts) {
  return gloo_->alltoall(outputs, inputs, opts);
}

void ShmBackend::monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) {
  gloo_->monitoredBarrier(opts, wait_all_ranks);
}

c10::intrusive_ptr<c10d::Work> ShmBackend::send(std::vector<at::Tensor>& tensors, int dst_rank, int tag) {
  return gloo_->send(tensors, dst_rank, tag);
}

c10::intrusive_ptr<c10d::Work> ShmBackend::recv(std::vector<at::Tensor>& tensors, int src_rank, int tag) {
  return gloo_->recv(tensors, src_rank, tag);
}

c10::intrusive_ptr<c10d::Work> ShmBackend::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  return gloo_->recvAnysource(tensors, tag);
}

}  // namespace fastpar::shm
