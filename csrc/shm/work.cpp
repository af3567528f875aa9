// Work objects and the in-order executor of fastpar's same-host collectives.
#include "shm/work.h"

#include <ATen/core/jit_type.h>
#include <c10/util/Exception.h>
#include <pthread.h>

#include <utility>

namespace fastpar::shm {

ShmWork::ShmWork(int rank, c10d::OpType type, const char* title, std::vector<at::Tensor> outputs, Body body,
                 const std::shared_ptr<Executor>& executor)
    : c10d::Work(rank, type, title),
      outputs_(std::move(outputs)),
      body_(std::move(body)),
      executor_(executor),
      future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()))) {}

bool ShmWork::wait(std::chrono::milliseconds timeout) {
  // With a timeout the caller wants control back at it, so it only waits; without one it may as well do the work.
  if (timeout == kNoTimeout && !isCompleted()) {
    if (auto executor = executor_.lock()) executor->run_until_done(*this);
  }
  return c10d::Work::wait(timeout);
}

std::exception_ptr ShmWork::run_body(Group& group) {
  std::exception_ptr error;
  try {
    body_(group);
  } catch (...) {
    error = std::current_exception();
  }
  body_ = nullptr;  // drop the captured tensors now, not when Python lets go of the Work
  return error;
}

void ShmWork::complete(const std::exception_ptr& error) {
  finish(error);  // is_completed() is true before any future callback runs
  if (error) {
    future_->setError(error);
  } else {
    future_->markCompleted(c10::IValue(outputs_));
  }
}

Executor::Executor(std::unique_ptr<Group> group) : group_(std::move(group)) {}

Executor::~Executor() { shutdown(); }

void Executor::start() {
  std::promise<void> joined;
  auto ready = joined.get_future();
  worker_ = std::thread([self = shared_from_this(), &joined] { self->worker_main(&joined); });
  ready.get();  // rethrows a failed join
}

void Executor::worker_main(std::promise<void>* joined) {
  pthread_setname_np(pthread_self(), "fastpar-shm");
  try {
    group_->join();
    joined->set_value();
  } catch (...) {
    joined->set_exception(std::current_exception());
    return;
  }
  {
    std::unique_lock<std::mutex> lock(mutex_);
    serve(lock);
  }
  group_->leave();  // nothing is queued or running: the helpers only wait for the lock to exit
}

void Executor::serve(std::unique_lock<std::mutex>& lock) {
  while (true) {
    if (!running_ && !queue_.empty()) {
      run_head(lock);
    } else if (stopping_ && !running_ && queue_.empty()) {
      return;
    } else {
      ++idle_;
      changed_.wait(lock);
      --idle_;
    }
  }
}

void Executor::add_helper() {
  helpers_.emplace_back([self = shared_from_this()] {
    pthread_setname_np(pthread_self(), "fastpar-shm-cb");
    std::unique_lock<std::mutex> lock(self->mutex_);
    self->serve(lock);
  });
}

void Executor::run_head(std::unique_lock<std::mutex>& lock) {
  c10::intrusive_ptr<ShmWork> work = std::move(queue_.front());
  queue_.pop_front();
  running_ = true;
  lock.unlock();
  const std::exception_ptr error = work->run_body(*group_);
  lock.lock();
  running_ = false;
  // The callbacks run next, on this thread, and may wait for a collective issued after this one: another thread
  // must be free to run it, or that wait could only end at the timeout.
  if (idle_ == 0 && !stopping_) add_helper();
  changed_.notify_all();
  lock.unlock();
  work->complete(error);
  work.reset();
  lock.lock();
  changed_.notify_all();  // run_until_done() waits for the completion, not only for the queue
}

void Executor::submit(c10::intrusive_ptr<ShmWork> work) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (stopping_) {
    lock.unlock();
    work->complete(std::make_exception_ptr(c10::DistBackendError(
        {__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
        "fastpar shm backend: collective issued after the process group was shut down")));
    return;
  }
  queue_.push_back(std::move(work));
  changed_.notify_all();
}

void Executor::run_until_done(ShmWork& work) {
  std::unique_lock<std::mutex> lock(mutex_);
  while (!work.isCompleted()) {
    if (!running_ && !queue_.empty()) {
      run_head(lock);  // the head is this work or one issued before it: it has to run first anyway
    } else if (stopping_ && !running_ && queue_.empty()) {
      return;
    } else {
      changed_.wait(lock);
    }
  }
}

void Executor::run_now(c10::intrusive_ptr<ShmWork> work) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (stopping_ || running_ || !queue_.empty()) {
    lock.unlock();
    submit(work);
    run_until_done(*work);
    return;
  }
  queue_.push_back(work);
  run_head(lock);  // this work: the queue was empty and nobody runs it
}

void Executor::shutdown() {
  std::vector<std::thread> threads;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
    changed_.notify_all();
    if (worker_.joinable()) threads.push_back(std::move(worker_));
    for (auto& helper : helpers_) threads.push_back(std::move(helper));
    helpers_.clear();
  }
  for (auto& thread : threads) {
    if (thread.get_id() == std::this_thread::get_id()) {
      thread.detach();  // shut down from a future callback on one of ours: it exits when the callback returns
    } else {
      thread.join();
    }
  }
}

void Executor::abort(const std::string& why) {
  std::deque<c10::intrusive_ptr<ShmWork>> failed;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    failed.swap(queue_);
  }
  std::exception_ptr error;
  try {
    group_->abort(why);  // wakes a collective running here and every other rank's
  } catch (...) {
    error = std::current_exception();
  }
  for (auto& work : failed) work->complete(error);
}

}  // namespace fastpar::shm
