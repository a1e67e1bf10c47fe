// The async_io engine: parallel, asynchronous reads and writes of host buffers to files.
//
// This header and aio_engine.cpp / aio_rings.cpp know nothing of torch (the buffer's owner is kept alive
// through an opaque `keepalive`), so only aio_py.cpp pays for torch's headers at build time.
//
// [Note: aio request plan]
// - A request is one buffer [data, data + nbytes) and one file range [offset, offset + nbytes).
// - O_DIRECT needs file offsets, lengths and memory addresses aligned to the device's logical block; we use
//   kAlignment (4096, a page), which covers 512-byte and 4K-native devices. The aligned middle of the file
//   range, the "body", goes through an O_DIRECT descriptor; the unaligned head and tail (at most 4095 bytes
//   each) through a plain one. Body and head/tail never share a page, so page-cache coherence holds.
// - When the buffer is not aligned the same way as the file offset (any torch.empty tensor: its data starts
//   64 bytes into a page), body chunks still use O_DIRECT through per-worker aligned bounce buffers (a
//   memcpy of each chunk on the worker thread). Buffers from new_cpu_locked_tensor need no bounce.
// - The body is cut into chunks of block_size (rounded up to kAlignment); head and tail are single chunks.
//   All chunks of all requests go into one FIFO queue that the workers drain.
// - If the file system refuses O_DIRECT (open gives EINVAL), the whole range uses plain I/O.
// - A direct chunk that completes partially finishes on the plain descriptor (the rest may be unaligned).
//
// [Note: aio workers]
// - Engines, in order of preference (compiled_engines() in aio_rings.cpp says why): libaio, io_uring, sync;
//   SLIPSTREAM_AIO_ENGINE picks one. The first that starts on this kernel serves the handle.
// - libaio and io_uring: `intra_op_parallelism` worker threads, each owning a ring of `queue_depth` slots;
//   a worker takes chunks while it has free slots, submits them in one batch (or one by one with
//   single_submit), then blocks for at least one completion. With overlap_events=false a worker takes new
//   chunks only when its ring is empty (batch by batch, DeepSpeed's sequential mode).
// - sync (neither library, or both refused at run time, e.g. by a seccomp profile): intra_op_parallelism *
//   min(queue_depth, 8) threads doing pread/pwrite, one chunk each at a time.
// - A request finishes when its last chunk does; the worker that finishes it closes its descriptors.
//   wait() blocks until every submitted request finished, checks that each written file still exists, and
//   raises the first failure, after all I/O into the caller's buffers has stopped.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace slipstream_aio {

inline constexpr int64_t kAlignment = 4096;

struct Config {
  int64_t block_size = 1 << 20;
  int queue_depth = 128;
  bool single_submit = false;
  bool overlap_events = true;
  int intra_op_parallelism = 1;
  std::string engine = "auto";  // auto | io_uring | libaio | sync
  bool use_direct = true;       // O_DIRECT for aligned bodies
};

// A failed request; aio_py.cpp turns it into slipstream.ops.aio.errors.AsyncIOError.
struct IoFailure : std::runtime_error {
  IoFailure(int err_, std::string operation_, std::string filename_, int64_t offset_, int64_t size_,
            std::string detail_, int64_t at_, int64_t num_failed_);
  int err;
  std::string operation;  // "read" or "write"
  std::string filename;
  int64_t offset;
  int64_t size;
  std::string detail;
  int64_t at;  // file offset where it failed (-1 when not known)
  int64_t num_failed;
};

struct Request {
  bool is_read = false;
  std::string filename;
  char* data = nullptr;
  int64_t offset = 0;
  int64_t nbytes = 0;
  int fd_plain = -1;
  int fd_direct = -1;
  std::shared_ptr<void> keepalive;
  std::atomic<int64_t> chunks_left{0};
  std::mutex error_mutex;
  int err = 0;
  int64_t err_at = -1;
  std::string err_detail;

  void fail(int error, int64_t at, const std::string& detail);
  void close_files();
};

struct Chunk {
  Request* req;
  int64_t pos;  // offset of the chunk inside the request
  int64_t len;
  bool direct;
  bool bounce;
};

// A completion queue of one worker: io_uring, libaio, or synchronous pread/pwrite (aio_rings.cpp).
class Ring {
 public:
  virtual ~Ring() = default;
  virtual int depth() const = 0;
  // Called once on the worker thread before any other use (an io_uring ring binds to its submitter there).
  virtual void attach() {}
  // Queue one transfer tagged `slot`; it reaches the kernel at the next submit().
  virtual void prepare(uint32_t slot, bool is_read, int fd, char* buf, int64_t len, int64_t offset) = 0;
  virtual void submit() = 0;
  // Append (slot, bytes or -errno) of finished transfers; blocks until there is at least one.
  virtual void reap(std::vector<std::pair<uint32_t, int64_t>>& out) = 0;
};

// A ring of `kind` ("io_uring", "libaio", "sync") with `depth` slots, or nullptr and a reason in `why`.
std::unique_ptr<Ring> make_ring(const std::string& kind, int depth, std::string& why);
// Engines compiled in, in order of preference.
std::vector<std::string> compiled_engines();

class Engine {
 public:
  explicit Engine(const Config& cfg);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Queue a transfer; throws IoFailure when the file cannot be opened, is too short for a read, or has
  // no room for a write. `keepalive` owns `data` until the next wait().
  void submit(bool is_read, char* data, int64_t nbytes, const std::string& filename, int64_t offset,
              std::shared_ptr<void> keepalive);
  // Block until every submitted request finished; returns how many, throws the first failure.
  int64_t wait();

  const Config& config() const { return cfg_; }
  const std::string& engine_name() const { return engine_name_; }

 private:
  struct Slot;
  void run_worker(Ring& ring);
  void issue(Ring& ring, uint32_t index, Slot& slot);
  bool settle(Slot& slot, int64_t result);
  void complete_chunk(const Chunk& chunk);
  void finish_request(Request& req);
  std::vector<Chunk> plan(Request& req, bool use_direct) const;
  int64_t chunk_bytes() const;

  Config cfg_;
  std::string engine_name_;
  std::vector<std::unique_ptr<Ring>> rings_;
  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  std::deque<Chunk> queue_;
  std::vector<std::unique_ptr<Request>> pending_;
  int64_t unfinished_ = 0;
  bool stopping_ = false;
};

}  // namespace slipstream_aio
