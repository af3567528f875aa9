// The "fastpar" backend on a group that spans nodes: each collective in three phases, so that each node sends its
// data across the network once instead of once per rank.
//   all-reduce: the node's ranks sum in shared memory (gloo's order over the node's ranks, by ascending rank), the
//     node leaders all-reduce those sums on gloo (gloo's order over the nodes), and each leader's result is copied
//     to its node's ranks: every rank ends with the same bits. AVG divides that sum by the group size. Each tensor
//     goes in chunks of 1 MiB (node_sum), each summed as its own all-reduce, pipelined so the wire stays busy.
//   reduce-scatter: as gloo, an all-reduce of the whole input (the same three phases), keeping this rank's share.
//   all-gather: the node's inputs gathered in shared memory, the leaders all-gather the nodes' blocks, the leader's
//     result copied to its node.
//   broadcast: within the root's node, then among the leaders from the root's node, then within the other nodes.
// A leader whose gloo step fails aborts its node's shared-memory group, so the node's other ranks fail at once with
// the leader's error instead of waiting out their timeout.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include "shm/backend.h"
#include "shm/collectives.h"
#include "shm/dense.h"
#include "text.h"

namespace fastpar::shm {
namespace {

using c10d::OpType;

// Waits for the leaders' gloo step of `what`; on failure, aborts the node's group (every local rank fails with it).
void finish_leaders(Group& g, const c10::intrusive_ptr<c10d::Work>& work, const NodeLayout& layout, const char* what) {
  try {
    work->wait();
  } catch (const std::exception& e) {
    g.abort(text("fastpar backend: the step of ", what, " between the node leaders failed on node ", layout.node,
                 " (its leader, rank ", layout.members[layout.node][0], "): ", message_of(e)));
  }
}

int64_t bytes_of(const at::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }

// The leaders' all-reduce runs in chunks of this many bytes, pipelined with the node's shared-memory phases of the
// neighbouring chunks, so the wire is not idle while a node sums or copies.
constexpr int64_t kChunkBytes = int64_t{1} << 20;

// `flat` (contiguous tensors of one dtype) becomes the sum over the group, the same bits on every rank. Chunk by
// chunk (each tensor cut into kChunkBytes pieces): the node's ranks sum chunk k in shared memory, the leader starts
// its gloo all-reduce and the node sums chunk k + 1 meanwhile, then the leader's result of chunk k is copied to the
// node. Every rank runs the same shared-memory steps in the same order; only the leader talks to gloo.
void node_sum(Group& g, const NodeLayout& layout, const std::vector<at::Tensor>& flat,
              std::chrono::milliseconds timeout) {
  const at::ScalarType dtype = flat.front().scalar_type();
  const int64_t per_chunk = std::max<int64_t>(1, kChunkBytes / static_cast<int64_t>(flat.front().element_size()));
  std::vector<at::Tensor> chunks;
  for (const auto& t : flat) {
    const at::Tensor line = t.reshape(-1);
    for (int64_t at = 0; at < line.numel(); at += per_chunk) {
      chunks.push_back(line.narrow(0, at, std::min(per_chunk, line.numel() - at)));
    }
  }
  const bool local = g.world() > 1;
  std::vector<c10::intrusive_ptr<c10d::Work>> pending(chunks.size());
  auto finish = [&](size_t k) {
    if (layout.leaders) finish_leaders(g, pending[k], layout, "an all-reduce");
    pending[k].reset();
    if (local) broadcast(g, chunks[k].data_ptr(), bytes_of(chunks[k]), 0, static_cast<int32_t>(dtype), timeout);
  };
  try {
    for (size_t k = 0; k < chunks.size(); ++k) {
      if (local) {
        const std::vector<Span> span{{static_cast<char*>(chunks[k].data_ptr()), chunks[k].numel()}};
        all_reduce(g, span, Reduction{dtype, false}, timeout);
      }
      if (layout.leaders) {
        std::vector<at::Tensor> one{chunks[k]};
        pending[k] = layout.leaders->allreduce(one, c10d::AllreduceOptions{});
      }
      if (k > 0) finish(k - 1);
    }
    if (!chunks.empty()) finish(chunks.size() - 1);
  } catch (...) {
    for (auto& work : pending) {  // the gloo works still write into the chunks: let them end first
      if (!work) continue;
      try {
        work->wait();
      } catch (const std::exception&) {
      }
    }
    throw;
  }
}

bool is_average(const c10d::ReduceOp& op) { return op.op_ == c10d::ReduceOp::AVG; }

}  // namespace

NodeLayout::NodeLayout(const std::vector<int>& node_of_rank, int rank,
                       c10::intrusive_ptr<c10d::Backend> leaders_backend)
    : node_of(node_of_rank), local_of(node_of_rank.size()), leaders(std::move(leaders_backend)) {
  TORCH_CHECK(rank >= 0 && rank < static_cast<int>(node_of.size()),
              text("fastpar backend: rank ", rank, " outside a node layout of ", node_of.size(), " ranks"));
  for (size_t r = 0; r < node_of.size(); ++r) {
    const int n = node_of[r];
    TORCH_CHECK(n >= 0 && n <= static_cast<int>(members.size()),
                text("fastpar backend: nodes must be numbered by their lowest rank; rank ", r, " is on node ", n));
    if (n == static_cast<int>(members.size())) members.emplace_back();
    local_of[r] = static_cast<int>(members[n].size());
    members[n].push_back(static_cast<int>(r));
  }
  node = node_of[rank];
  const bool leader = members[node][0] == rank;
  TORCH_CHECK(leader == static_cast<bool>(leaders),
              text("fastpar backend: rank ", rank, (leader ? " leads" : " does not lead"), " node ", node,
                   " but was ", (leaders ? "given" : "not given"), " the leaders' backend"));
  uniform = true;
  blocked = true;
  const size_t per_node = members[0].size();
  for (const auto& m : members) uniform = uniform && m.size() == per_node;
  for (size_t r = 0; r < node_of.size(); ++r) {
    blocked = blocked && uniform && node_of[r] == static_cast<int>(r / per_node);
  }
}

std::string ShmBackend::attach_nodes(const std::string& name, uint64_t token, const std::vector<int>& node_of,
                                     c10::intrusive_ptr<c10d::Backend> leaders) {
  try {
    auto layout = std::make_shared<const NodeLayout>(node_of, rank_, std::move(leaders));
    TORCH_CHECK(static_cast<int>(node_of.size()) == size_,
                text("fastpar backend: a node layout of ", node_of.size(), " ranks for a group of ", size_));
    auto group = std::make_unique<Group>(Segment::open(name, layout->local_size(), token), layout->local_of[rank_],
                                         options_->timeout);
    auto executor = std::make_shared<Executor>(std::move(group));
    executor->start();
    executor_ = std::move(executor);
    layout_ = std::move(layout);
    reason_.clear();
  } catch (const std::exception& e) {
    reason_ = message_of(e);
  }
  return reason_;
}

c10::intrusive_ptr<c10d::Work> ShmBackend::nodes_all_reduce(const std::vector<at::Tensor>& tensors,
                                                            const c10d::ReduceOp& op,
                                                            std::chrono::milliseconds timeout, OpType type,
                                                            const char* title) {
  // One tensor in storage order (as gloo sums it); a list in logical order (gloo flattens it).
  const std::vector<Dense> dense = dense_all(tensors, tensors.size() == 1 ? Order::kStorage : Order::kLogical);
  const bool average = is_average(op);
  const int size = size_;
  return enqueue(type, title, tensors, [layout = layout_, dense, average, size, timeout](Group& g) {
    std::vector<at::Tensor> flat;
    for (const auto& t : dense) flat.push_back(t.data);
    node_sum(g, *layout, flat, timeout);
    for (const auto& t : dense) {
      if (average) t.data.div_(size);
      t.write_back();
    }
  });
}

c10::intrusive_ptr<c10d::Work> ShmBackend::nodes_reduce_scatter(std::vector<at::Tensor>& outputs,
                                                                const std::vector<at::Tensor>& inputs,
                                                                const c10d::ReduceOp& op,
                                                                std::chrono::milliseconds timeout) {
  const std::vector<Dense> ins = dense_all(inputs, Order::kStorage);
  const std::vector<Dense> outs = dense_all(outputs);
  const bool average = is_average(op);
  const int size = size_, rank = rank_;
  return enqueue(OpType::_REDUCE_SCATTER_BASE, "fastpar:reduce_scatter_tensor", outputs,
                 [layout = layout_, ins, outs, average, size, rank, timeout](Group& g) {
                   for (size_t i = 0; i < ins.size(); ++i) {
                     const Dense& in = ins[i];
                     // Sums laid out like the input (its storage order is the order summed), then share `rank`
                     // of the logical order.
                     at::Tensor sums = in.reordered
                                           ? at::empty_strided(in.user.sizes(), in.user.strides(), in.user.options())
                                           : at::empty(in.user.sizes(), in.user.options());
                     at::Tensor flat = sums.as_strided({sums.numel()}, {1});
                     flat.copy_(in.data.reshape(-1));
                     node_sum(g, *layout, {flat}, timeout);
                     if (average) flat.div_(size);
                     const int64_t count = outs[i].user.numel();
                     outs[i].user.copy_(sums.reshape(-1).narrow(0, rank * count, count).view(outs[i].user.sizes()));
                   }
                 });
}

c10::intrusive_ptr<c10d::Work> ShmBackend::nodes_all_gather(std::vector<at::Tensor>& outputs,
                                                            const std::vector<at::Tensor>& inputs,
                                                            std::chrono::milliseconds timeout) {
  const std::vector<Dense> ins = dense_all(inputs);
  const std::vector<Dense> outs = dense_all(outputs);
  return enqueue(OpType::_ALLGATHER_BASE, "fastpar:all_gather_into_tensor", outputs,
                 [layout = layout_, ins, outs, timeout](Group& g) {
                   const NodeLayout& L = *layout;
                   const int local = g.world();
                   for (size_t i = 0; i < ins.size(); ++i) {
                     const Dense& in = ins[i];
                     const int64_t bytes = in.bytes();
                     // Every node's block, in node order; when the nodes' blocks lie in rank order that is the
                     // output itself.
                     at::Tensor all = L.blocked ? outs[i].data.reshape(-1)
                                                : at::empty({L.nodes() * local * in.numel()}, in.data.options());
                     char* base = static_cast<char*>(all.data_ptr());
                     std::vector<void*> shares(local);
                     for (int q = 0; q < local; ++q) shares[q] = base + (int64_t{L.node} * local + q) * bytes;
                     if (local > 1) {
                       shm::all_gather(g, in.ptr(), shares, bytes, in.dtype(), timeout);
                     } else {
                       std::memcpy(shares[0], in.ptr(), bytes);
                     }
                     if (L.leaders) {
                       const int64_t block = local * in.numel();
                       at::Tensor mine = all.narrow(0, int64_t{L.node} * block, block).clone();
                       finish_leaders(g, L.leaders->_allgather_base(all, mine, c10d::AllgatherOptions{}), L,
                                      "an all-gather");
                     }
                     if (local > 1) shm::broadcast(g, base, bytes_of(all), 0, in.dtype(), timeout);
                     if (!L.blocked) {
                       char* out = outs[i].ptr();
                       for (size_t r = 0; r < L.node_of.size(); ++r) {
                         std::memcpy(out + r * bytes, base + (int64_t{L.node_of[r]} * local + L.local_of[r]) * bytes,
                                     bytes);
                       }
                     }
                     outs[i].write_back();
                   }
                 });
}

c10::intrusive_ptr<c10d::Work> ShmBackend::nodes_broadcast(std::vector<at::Tensor>& tensors, int root,
                                                           std::chrono::milliseconds timeout) {
  const Dense t(tensors[0]);
  const int rank = rank_;
  return enqueue(OpType::BROADCAST, "fastpar:broadcast", tensors, [layout = layout_, t, root, rank, timeout](Group& g) {
    const NodeLayout& L = *layout;
    const int root_node = L.node_of[root];
    if (L.node == root_node && g.world() > 1) {
      shm::broadcast(g, t.ptr(), t.bytes(), L.local_of[root], t.dtype(), timeout);
    }
    if (L.leaders) {
      std::vector<at::Tensor> list{t.data};
      c10d::BroadcastOptions opts;
      opts.rootRank = root_node;
      finish_leaders(g, L.leaders->broadcast(list, opts), L, "a broadcast");
    }
    if (L.node != root_node && g.world() > 1) shm::broadcast(g, t.ptr(), t.bytes(), 0, t.dtype(), timeout);
    if (rank != root) t.write_back();
  });
}

c10::intrusive_ptr<c10d::Work> ShmBackend::nodes_barrier(std::chrono::milliseconds timeout) {
  return enqueue(OpType::BARRIER, "fastpar:barrier", {}, [layout = layout_, timeout](Group& g) {
    if (g.world() > 1) shm::barrier(g, timeout);
    if (layout->leaders) finish_leaders(g, layout->leaders->barrier(c10d::BarrierOptions{}), *layout, "a barrier");
    if (g.world() > 1) shm::barrier(g, timeout);
  });
}

}  // namespace fastpar::shm
