// Asynchronous execution of fastpar's same-host collectives: every collective is a ShmWork (a c10d::Work with a
// future, as gloo's) queued on the group's Executor. A worker thread runs the queue in order, without the GIL, so
// DDP's buckets reduce while backward goes on; a caller blocked in work.wait() runs queued collectives itself
// instead of waiting for the worker to be scheduled (a synchronous all_reduce costs no thread hand-off).
// A collective's future callbacks run after the queue is free again, and never on the only thread that could run
// it: a callback may issue a collective and wait for it (torch's PowerSGD and quantization comm hooks do), so the
// executor adds a thread whenever the one that completes a future leaves no other to serve the queue.
#pragma once

#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "shm/group.h"

namespace fastpar::shm {

class Executor;

class ShmWork : public c10d::Work {
 public:
  using Body = std::function<void(Group&)>;

  ShmWork(int rank, c10d::OpType type, const char* title, std::vector<at::Tensor> outputs, Body body,
          const std::shared_ptr<Executor>& executor);

  bool wait(std::chrono::milliseconds timeout) override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }
  std::vector<at::Tensor> result() override { return outputs_; }

  std::exception_ptr run_body(Group& group);  // never throws: returns the body's error
  // Marks the work done and completes its future, which runs the future's callbacks on this thread.
  void complete(const std::exception_ptr& error);

 private:
  std::vector<at::Tensor> outputs_;
  Body body_;
  std::weak_ptr<Executor> executor_;  // a Work may outlive its process group
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

class Executor : public std::enable_shared_from_this<Executor> {
 public:
  explicit Executor(std::unique_ptr<Group> group);
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;
  ~Executor();

  // Starts the worker thread; returns once it joined the group (holds this rank's liveness lock). The executor must
  // be owned by a shared_ptr: its threads keep it alive until they have stopped.
  void start();
  void submit(c10::intrusive_ptr<ShmWork> work);
  // Runs queued collectives on the calling thread until `work` is completed (or the executor stops).
  void run_until_done(ShmWork& work);
  // For a caller that would wait at once: runs `work` on the calling thread when nothing is queued or running (no
  // worker wake-up, no hand-off), else queues it and runs the queue until it is done. Then `work` is completed.
  void run_now(c10::intrusive_ptr<ShmWork> work);
  // Lets the queued collectives finish (as gloo's destructor does), then leaves the group and stops the worker.
  void shutdown();
  // Marks the group broken for every rank and fails what is queued here.
  void abort(const std::string& why);
  Group& group() { return *group_; }

 private:
  void worker_main(std::promise<void>* joined);
  void serve(std::unique_lock<std::mutex>& lock);  // runs the queue until stopped and drained
  void run_head(std::unique_lock<std::mutex>& lock);
  void add_helper();  // with the lock held

  std::unique_ptr<Group> group_;
  std::mutex mutex_;
  std::condition_variable changed_;  // queue grew, or a collective finished
  std::deque<c10::intrusive_ptr<ShmWork>> queue_;
  bool running_ = false;  // some thread is running the head of the queue
  bool stopping_ = false;
  int idle_ = 0;  // threads in serve() waiting for work: free to run the queue
  std::thread worker_;  // holds the liveness lock: lives as long as the membership
  std::vector<std::thread> helpers_;  // serve the queue while other threads are inside future callbacks
};

}  // namespace fastpar::shm
