// fastpar's torch.distributed backend ("fastpar"): all-reduce, reduce-scatter, all-gather, broadcast and barrier
// between ranks of one host go through POSIX shared memory (shm_collectives); on a group spanning hosts ("nodes")
// the same five run hierarchically (nodes.cpp): shared memory within each node, gloo among one leader per node.
// Everything else, and tensors it does not handle (non-CPU, sparse, unsupported dtypes or reduce ops), goes to a
// gloo backend over the whole group that it owns.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "shm/collectives.h"
#include "shm/shared_buffers.h"
#include "shm/work.h"

namespace pybind11 {
class module_;
}

namespace fastpar::shm {

// Where the ranks of a group that spans nodes are: nodes are numbered by their lowest rank, which is the node's
// leader; the leaders run a gloo backend of their own (rank = node number), absent on the other ranks.
struct NodeLayout {
  NodeLayout(const std::vector<int>& node_of_rank, int rank, c10::intrusive_ptr<c10d::Backend> leaders_backend);
  std::vector<int> node_of;  // rank -> node
  std::vector<int> local_of;  // rank -> its place among its node's ranks (ascending rank)
  std::vector<std::vector<int>> members;  // node -> its ranks, ascending
  int node;  // this rank's
  c10::intrusive_ptr<c10d::Backend> leaders;  // null off the leaders
  bool uniform;  // every node has as many ranks (all-gather among leaders needs equal shares)
  bool blocked;  // rank r is on node r / ranks-per-node: the nodes' blocks lie in rank order
  int nodes() const { return static_cast<int>(members.size()); }
  int local_size() const { return static_cast<int>(members[node].size()); }
};

class ShmBackend : public c10d::Backend {
 public:
  ShmBackend(int rank, int size, c10::intrusive_ptr<c10d::Backend> gloo, std::chrono::milliseconds timeout);
  ~ShmBackend() override;

  // Maps the group's segment and joins it; returns "" or why it could not (then everything goes to gloo).
  std::string attach(const std::string& name, uint64_t token);
  // The same on a group spanning nodes: maps this node's segment (its ranks only) and runs the five collectives
  // hierarchically. `node_of` gives every rank's node; `leaders` is the leaders' gloo backend (null off them).
  std::string attach_nodes(const std::string& name, uint64_t token, const std::vector<int>& node_of,
                           c10::intrusive_ptr<c10d::Backend> leaders);
  // Leaves the segment: from now on everything goes to gloo (when not every rank could attach).
  void detach(const std::string& reason);
  // On one host's shared memory (then all_reduce_lists and shared buffers work too).
  bool shm_active() const { return executor_ != nullptr && !layout_; }
  int nodes() const { return executor_ && layout_ ? layout_->nodes() : 0; }  // 0: not across nodes
  const std::string& fallback_reason() const { return reason_; }
  c10::intrusive_ptr<c10d::Backend> gloo() const { return gloo_; }
  // The wait and thread policy fastpar/comm/threads.py chooses: how long waits spin before they sleep, how many
  // threads one reduction splits over. Called before the first collective.
  void set_thread_policy(int64_t spin_us, int summation_threads);
  std::tuple<int64_t, int> thread_policy() const;
  // One list all-reduce (SUM, each list of one reducible dtype, CPU) per entry of `lists`, all queued before the
  // first wait, then waited for: allreduce_coalesced without the dispatcher's per-tensor boxing, for callers that
  // hold the tensors until it returns (fastpar.ddp.CoalescedAllReduce). Needs the shared-memory path.
  void all_reduce_lists(const std::vector<std::vector<at::Tensor>>& lists);
  // Buffers every rank maps (shared_buffers.h; created collectively by fastpar/comm/shared_buffers.py). An
  // all-reduce of a contiguous tensor inside one runs without staging. Needs the shared-memory path.
  SharedBuffers& shared_buffers();

  const std::string getBackendName() const override { return "fastpar"; }
  c10::intrusive_ptr<Options> getBackendOptions() override { return options_; }
  void setTimeout(std::chrono::milliseconds timeout) override;
  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override { return seq_.load(); }
  c10d::ErrorType getError() override;
  void abort() override;
  void shutdown() override;

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;

  // Delegated to gloo as they are.
  c10::intrusive_ptr<c10d::Work> allreduce_sparse(std::vector<at::Tensor>& tensors,
                                                  const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_split_sizes,
                                               std::vector<int64_t>& input_split_sizes,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst_rank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src_rank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;

 private:
  c10::intrusive_ptr<c10d::Work> enqueue(c10d::OpType type, const char* title, std::vector<at::Tensor> outputs,
                                         ShmWork::Body body);
  std::chrono::milliseconds op_timeout(std::chrono::milliseconds requested) const;
  bool flat() const { return executor_ && !layout_; }  // the one-host path
  bool across_nodes() const { return executor_ && layout_; }
  // The across-nodes forms (nodes.cpp), for the tensors the one-host path takes.
  c10::intrusive_ptr<c10d::Work> nodes_all_reduce(const std::vector<at::Tensor>& tensors, const c10d::ReduceOp& op,
                                                  std::chrono::milliseconds timeout, c10d::OpType type,
                                                  const char* title);
  c10::intrusive_ptr<c10d::Work> nodes_reduce_scatter(std::vector<at::Tensor>& outputs,
                                                      const std::vector<at::Tensor>& inputs, const c10d::ReduceOp& op,
                                                      std::chrono::milliseconds timeout);
  c10::intrusive_ptr<c10d::Work> nodes_all_gather(std::vector<at::Tensor>& outputs,
                                                  const std::vector<at::Tensor>& inputs,
                                                  std::chrono::milliseconds timeout);
  c10::intrusive_ptr<c10d::Work> nodes_broadcast(std::vector<at::Tensor>& tensors, int root,
                                                 std::chrono::milliseconds timeout);
  c10::intrusive_ptr<c10d::Work> nodes_barrier(std::chrono::milliseconds timeout);
  c10::intrusive_ptr<ShmWork> list_work(const std::vector<at::Tensor>& tensors, Reduction reduction,
                                        std::chrono::milliseconds timeout, c10d::OpType type, const char* title,
                                        std::vector<at::Tensor> outputs);

  c10::intrusive_ptr<c10d::Backend> gloo_;
  c10::intrusive_ptr<Options> options_;
  std::shared_ptr<Executor> executor_;  // null: everything goes to gloo
  std::unique_ptr<SharedBuffers> shared_;  // with the executor, on one host
  std::shared_ptr<const NodeLayout> layout_;  // with the executor, across nodes (bodies of queued work hold it)
  std::string reason_;
  std::atomic<uint64_t> seq_{0};  // collectives issued (DDP and the profiler read it)
};

// Python bindings (fastpar._C): the ShmBackend class and the segment helpers the Python rendezvous uses.
void bind(pybind11::module_& m);

}  // namespace fastpar::shm
