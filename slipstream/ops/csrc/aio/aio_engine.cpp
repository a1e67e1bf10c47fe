// The async_io engine: request planning, the shared chunk queue and the worker loop.
// See [Note: aio request plan] and [Note: aio workers] in aio_engine.h.
#include "aio_engine.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <numeric>

namespace slipstream_aio {

namespace {

constexpr int kMaxSyncThreadsPerOp = 8;
constexpr int kMaxBounceBuffers = 16;

int64_t round_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }
int64_t round_down(int64_t x, int64_t a) { return x / a * a; }

// Aligned bounce buffers of one worker, allocated on first use and freed with the worker.
class BouncePool {
 public:
  BouncePool(int count, int64_t bytes) : count_(count), bytes_(bytes) {}
  ~BouncePool() {
    for (char* p : all_) std::free(p);
  }
  char* take() {
    if (!free_.empty()) {
      char* p = free_.back();
      free_.pop_back();
      return p;
    }
    if (static_cast<int>(all_.size()) >= count_) return nullptr;
    void* p = nullptr;
    if (posix_memalign(&p, static_cast<size_t>(kAlignment), static_cast<size_t>(bytes_)) != 0) return nullptr;
    all_.push_back(static_cast<char*>(p));
    return static_cast<char*>(p);
  }
  void give(char* p) {
    if (p != nullptr) free_.push_back(p);
  }

 private:
  int count_;
  int64_t bytes_;
  std::vector<char*> all_;
  std::vector<char*> free_;
};

std::string describe_open_error(int err, bool is_read) {
  if (err == ENOENT && !is_read) return "open for write: its directory does not exist";
  return is_read ? "open for read" : "open for write";
}

}  // namespace

IoFailure::IoFailure(int err_, std::string operation_, std::string filename_, int64_t offset_, int64_t size_,
                     std::string detail_, int64_t at_, int64_t num_failed_)
    : std::runtime_error("async_io " + operation_ + " of '" + filename_ + "' failed: " + std::strerror(err_) +
                         (detail_.empty() ? "" : "; " + detail_)),
      err(err_),
      operation(std::move(operation_)),
      filename(std::move(filename_)),
      offset(offset_),
      size(size_),
      detail(std::move(detail_)),
      at(at_),
      num_failed(num_failed_) {}

void Request::fail(int error, int64_t at, const std::string& detail) {
  std::lock_guard<std::mutex> lock(error_mutex);
  if (err == 0) {
    err = error;
    err_at = at;
    err_detail = detail;
  }
}

void Request::close_files() {
  if (fd_direct >= 0) close(fd_direct);
  if (fd_plain >= 0) close(fd_plain);
  fd_direct = fd_plain = -1;
}

struct Engine::Slot {
  Chunk chunk{};
  int64_t done = 0;
  char* bounce = nullptr;
  bool plain_rest = false;  // a partial direct transfer finishes on the plain descriptor
};

Engine::Engine(const Config& cfg) : cfg_(cfg) {
  if (cfg_.block_size <= 0 || cfg_.queue_depth <= 0 || cfg_.intra_op_parallelism <= 0) {
    throw std::invalid_argument("async_io: block_size, queue_depth and intra_op_parallelism must be positive (got " +
                                std::to_string(cfg_.block_size) + ", " + std::to_string(cfg_.queue_depth) + ", " +
                                std::to_string(cfg_.intra_op_parallelism) + ")");
  }
  std::vector<std::string> kinds = cfg_.engine == "auto" ? compiled_engines() : std::vector<std::string>{cfg_.engine};
  std::string reasons;
  for (const std::string& kind : kinds) {
    const bool sync = kind == "sync";
    const int num_workers = sync ? cfg_.intra_op_parallelism * std::min(cfg_.queue_depth, kMaxSyncThreadsPerOp)
                                 : cfg_.intra_op_parallelism;
    std::vector<std::unique_ptr<Ring>> rings;
    std::string why;
    for (int i = 0; i < num_workers; ++i) {
      auto ring = make_ring(kind, sync ? 1 : cfg_.queue_depth, why);
      if (!ring) break;
      rings.push_back(std::move(ring));
    }
    if (static_cast<int>(rings.size()) == num_workers) {
      engine_name_ = kind;
      rings_ = std::move(rings);
      break;
    }
    reasons += (reasons.empty() ? "" : "; ") + kind + ": " + why;
  }
  if (rings_.empty()) {
    throw std::runtime_error("async_io: no I/O engine could start (" + reasons +
                             "); unset SLIPSTREAM_AIO_ENGINE or set it to 'sync'");
  }
  for (auto& ring : rings_) {
    Ring* r = ring.get();
    workers_.emplace_back([this, r] { run_worker(*r); });
  }
}

Engine::~Engine() {
  {
    std::unique_lock<std::mutex> lock(mutex_);
    done_cv_.wait(lock, [this] { return unfinished_ == 0; });
    stopping_ = true;
  }
  work_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

int64_t Engine::chunk_bytes() const { return round_up(cfg_.block_size, kAlignment); }

std::vector<Chunk> Engine::plan(Request& req, bool use_direct) const {
  std::vector<Chunk> chunks;
  const int64_t begin = req.offset;
  const int64_t end = req.offset + req.nbytes;
  auto add = [&](int64_t from, int64_t to, bool direct, bool bounce, int64_t step) {
    for (int64_t p = from; p < to; p += step) {
      chunks.push_back(Chunk{&req, p - begin, std::min(step, to - p), direct, bounce});
    }
  };
  if (!use_direct) {
    add(begin, end, false, false, cfg_.block_size);
    return chunks;
  }
  const int64_t body_begin = round_up(begin, kAlignment);
  const int64_t body_end = round_down(end, kAlignment);
  const auto body_addr = reinterpret_cast<uintptr_t>(req.data + (body_begin - begin));
  add(begin, body_begin, false, false, kAlignment);
  add(body_begin, body_end, true, body_addr % kAlignment != 0, chunk_bytes());
  add(body_end, end, false, false, kAlignment);
  return chunks;
}

void Engine::submit(bool is_read, char* data, int64_t nbytes, const std::string& filename, int64_t offset,
                    std::shared_ptr<void> keepalive) {
  const std::string op = is_read ? "read" : "write";
  if (offset < 0) {
    throw std::invalid_argument("async_io: file_offset must be >= 0, got " + std::to_string(offset));
  }
  auto req = std::make_unique<Request>();
  req->is_read = is_read;
  req->filename = filename;
  req->data = data;
  req->offset = offset;
  req->nbytes = nbytes;
  req->keepalive = std::move(keepalive);
  auto failure = [&](int err, const std::string& detail) {
    req->close_files();
    return IoFailure(err, op, filename, offset, nbytes, detail, -1, 1);
  };
  const int plain_flags = (is_read ? O_RDONLY : (O_WRONLY | O_CREAT)) | O_CLOEXEC;
  req->fd_plain = open(filename.c_str(), plain_flags, 0600);
  if (req->fd_plain < 0) throw failure(errno, describe_open_error(errno, is_read));
  struct stat st {};
  if (fstat(req->fd_plain, &st) != 0) throw failure(errno, "fstat");
  const int64_t end = offset + nbytes;
  if (is_read && nbytes > 0 && st.st_size < end) {
    throw failure(EIO, "short read: the file is " + std::to_string(st.st_size) + " bytes long, the read needs bytes [" +
                           std::to_string(offset) + ", " + std::to_string(end) + ")");
  }
  bool use_direct = cfg_.use_direct && round_down(end, kAlignment) > round_up(offset, kAlignment);
  if (use_direct) {
    req->fd_direct = open(filename.c_str(), (is_read ? O_RDONLY : O_WRONLY) | O_DIRECT | O_CLOEXEC);
    use_direct = req->fd_direct >= 0;  // EINVAL: this file system has no O_DIRECT; plain I/O then
  }
  if (!is_read && st.st_size < end) {
    // Reserve the blocks up front: a full disk fails here, naming the file, rather than half way through,
    // and ext4 runs the O_DIRECT writes as overwrites, concurrently.
    if (fallocate(req->fd_plain, 0, offset, nbytes) != 0) {
      const int err = errno;
      if (err == ENOSPC || err == EDQUOT || err == EFBIG) throw failure(err, "reserving the file's blocks");
    }
  }
  std::vector<Chunk> chunks = plan(*req, use_direct);
  req->chunks_left.store(static_cast<int64_t>(chunks.size()));
  if (chunks.empty()) req->close_files();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!chunks.empty()) ++unfinished_;
    queue_.insert(queue_.end(), chunks.begin(), chunks.end());
    pending_.push_back(std::move(req));
  }
  if (chunks.size() > 1) {
    work_cv_.notify_all();
  } else if (!chunks.empty()) {
    work_cv_.notify_one();
  }
}

int64_t Engine::wait() {
  std::vector<std::unique_ptr<Request>> done;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    done_cv_.wait(lock, [this] { return unfinished_ == 0; });
    done.swap(pending_);
  }
  Request* first = nullptr;
  int64_t num_failed = 0;
  for (auto& r : done) {
    struct stat st {};
    if (!r->is_read && r->err == 0 && stat(r->filename.c_str(), &st) != 0 && errno == ENOENT) {
      r->fail(ENOENT, r->offset, "the file was removed before wait(); what was written is lost");
    }
    if (r->err != 0) {
      ++num_failed;
      if (first == nullptr) first = r.get();
    }
  }
  if (first != nullptr) {
    throw IoFailure(first->err, first->is_read ? "read" : "write", first->filename, first->offset, first->nbytes,
                    first->err_detail, first->err_at, num_failed);
  }
  return static_cast<int64_t>(done.size());
}

void Engine::issue(Ring& ring, uint32_t index, Slot& slot) {
  const Chunk& c = slot.chunk;
  Request& r = *c.req;
  const bool direct = c.direct && !slot.plain_rest;
  char* base = slot.bounce != nullptr ? slot.bounce : r.data + c.pos;
  ring.prepare(index, r.is_read, direct ? r.fd_direct : r.fd_plain, base + slot.done, c.len - slot.done,
               r.offset + c.pos + slot.done);
}

// Account for one completion of `slot`; true when its chunk is finished (done or failed).
bool Engine::settle(Slot& slot, int64_t result) {
  const Chunk& c = slot.chunk;
  Request& r = *c.req;
  const int64_t at = r.offset + c.pos + slot.done;
  if (result == -EINTR || result == -EAGAIN) return false;
  if (result < 0) {
    r.fail(static_cast<int>(-result), at, "");
    return true;
  }
  if (result == 0) {
    r.fail(EIO, at, r.is_read ? "short read: the file ends at byte " + std::to_string(at) +
                                    " (truncated while the read was in flight?)"
                              : "the write made no progress");
    return true;
  }
  slot.done += result;
  if (slot.done < c.len) {
    slot.plain_rest = slot.plain_rest || c.direct;
    return false;
  }
  if (r.is_read && slot.bounce != nullptr) std::memcpy(r.data + c.pos, slot.bounce, static_cast<size_t>(c.len));
  return true;
}

void Engine::complete_chunk(const Chunk& chunk) {
  if (chunk.req->chunks_left.fetch_sub(1) == 1) finish_request(*chunk.req);
}

void Engine::finish_request(Request& req) {
  req.close_files();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    --unfinished_;
  }
  done_cv_.notify_all();
}

void Engine::run_worker(Ring& ring) {
  ring.attach();
  const int depth = ring.depth();
  std::vector<Slot> slots(static_cast<size_t>(depth));
  std::vector<uint32_t> free_slots(static_cast<size_t>(depth));
  std::iota(free_slots.rbegin(), free_slots.rend(), 0u);
  BouncePool bounce(std::min(depth, kMaxBounceBuffers), chunk_bytes());
  std::vector<uint32_t> started;
  std::vector<std::pair<uint32_t, int64_t>> finished;
  int inflight = 0;
  for (;;) {
    started.clear();
    {
      std::unique_lock<std::mutex> lock(mutex_);
      if (inflight == 0) work_cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (inflight == 0 && queue_.empty()) return;  // stopping
      const bool may_take = cfg_.overlap_events || inflight == 0;
      while (may_take && inflight < depth && !queue_.empty()) {
        Chunk chunk = queue_.front();
        char* buffer = nullptr;
        if (chunk.bounce && (buffer = bounce.take()) == nullptr) {
          if (inflight > 0) break;  // one comes back at the next completion
          chunk.direct = chunk.bounce = false;  // out of memory for bounce buffers: plain I/O for this one
        }
        const uint32_t index = free_slots.back();
        free_slots.pop_back();
        slots[index] = Slot{chunk, 0, buffer, false};
        queue_.pop_front();
        ++inflight;
        started.push_back(index);
      }
    }
    for (uint32_t index : started) {
      Slot& s = slots[index];
      if (!s.chunk.req->is_read && s.bounce != nullptr) {
        std::memcpy(s.bounce, s.chunk.req->data + s.chunk.pos, static_cast<size_t>(s.chunk.len));
      }
      issue(ring, index, s);
      if (cfg_.single_submit) ring.submit();
    }
    if (!started.empty() && !cfg_.single_submit) ring.submit();
    if (inflight == 0) continue;
    finished.clear();
    ring.reap(finished);
    bool reissued = false;
    for (const auto& [index, result] : finished) {
      Slot& s = slots[index];
      if (!settle(s, result)) {
        issue(ring, index, s);
        reissued = true;
        continue;
      }
      bounce.give(s.bounce);
      const Chunk chunk = s.chunk;
      s = Slot{};
      free_slots.push_back(index);
      --inflight;
      complete_chunk(chunk);
    }
    if (reissued) ring.submit();
  }
}

}  // namespace slipstream_aio
