// The completion queues behind the async_io workers: io_uring (liburing), libaio, and plain pread/pwrite.
// Which ones exist is decided at build time by the builder (SLIPSTREAM_AIO_HAVE_URING / _HAVE_LIBAIO, or
// SLIPSTREAM_AIO_KERNEL_AIO: the "libaio" engine on the kernel's own AIO system calls, from
// <linux/aio_abi.h>, when libaio's development files are absent); which one runs, at run time (a kernel or
// seccomp profile may refuse io_uring_setup or io_setup).
#include "aio_engine.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#ifdef SLIPSTREAM_AIO_HAVE_URING
#include <liburing.h>
// Kernel ABI values that older liburing headers lack; a kernel that does not know a flag refuses it with
// EINVAL, and make_uring tries the next set.
#ifndef IORING_SETUP_COOP_TASKRUN
#define IORING_SETUP_COOP_TASKRUN (1U << 8)
#endif
#ifndef IORING_SETUP_SINGLE_ISSUER
#define IORING_SETUP_SINGLE_ISSUER (1U << 12)
#endif
#ifndef IORING_SETUP_DEFER_TASKRUN
#define IORING_SETUP_DEFER_TASKRUN (1U << 13)
#endif
#endif
#ifdef SLIPSTREAM_AIO_HAVE_LIBAIO
#include <libaio.h>
#elif defined(SLIPSTREAM_AIO_KERNEL_AIO)
#include <linux/aio_abi.h>
#include <time.h>
#endif

namespace slipstream_aio {

namespace {

struct Pending {
  uint32_t slot;
  bool is_read;
  int fd;
  char* buf;
  int64_t len;
  int64_t offset;
};

// Synchronous transfers, run by reap(): the parallelism comes from the number of worker threads.
class SyncRing final : public Ring {
 public:
  explicit SyncRing(int depth) : depth_(depth) {}
  int depth() const override { return depth_; }
  void prepare(uint32_t slot, bool is_read, int fd, char* buf, int64_t len, int64_t offset) override {
    queued_.push_back(Pending{slot, is_read, fd, buf, len, offset});
  }
  void submit() override {}
  void reap(std::vector<std::pair<uint32_t, int64_t>>& out) override {
    for (const Pending& p : queued_) {
      const ssize_t n = p.is_read ? pread(p.fd, p.buf, static_cast<size_t>(p.len), p.offset)
                                  : pwrite(p.fd, p.buf, static_cast<size_t>(p.len), p.offset);
      out.emplace_back(p.slot, n < 0 ? -static_cast<int64_t>(errno) : static_cast<int64_t>(n));
    }
    queued_.clear();
  }

 private:
  int depth_;
  std::vector<Pending> queued_;
};

#ifdef SLIPSTREAM_AIO_HAVE_URING
class UringRing final : public Ring {
 public:
  UringRing(int depth, io_uring ring, bool disabled) : depth_(depth), ring_(ring), disabled_(disabled) {}
  ~UringRing() override { io_uring_queue_exit(&ring_); }
  int depth() const override { return depth_; }
  void attach() override {
    // This thread becomes the ring's single issuer. A raw syscall: some liburing builds (Debian's 2.3)
    // declare io_uring_enable_rings but do not export it.
    if (disabled_ && syscall(__NR_io_uring_register, ring_.ring_fd, IORING_REGISTER_ENABLE_RINGS, nullptr, 0) < 0) {
      enable_error_ = errno;
    }
  }
  void prepare(uint32_t slot, bool is_read, int fd, char* buf, int64_t len, int64_t offset) override {
    io_uring_sqe* sqe = enable_error_ != 0 ? nullptr : io_uring_get_sqe(&ring_);
    if (sqe == nullptr) {  // cannot happen: at most `depth` transfers are ever outstanding
      failed_.emplace_back(slot, enable_error_ != 0 ? -enable_error_ : -EBUSY);
      return;
    }
    if (is_read) {
      io_uring_prep_read(sqe, fd, buf, static_cast<unsigned>(len), static_cast<uint64_t>(offset));
    } else {
      io_uring_prep_write(sqe, fd, buf, static_cast<unsigned>(len), static_cast<uint64_t>(offset));
    }
    io_uring_sqe_set_data(sqe, reinterpret_cast<void*>(static_cast<uintptr_t>(slot)));
  }
  void submit() override {
    for (;;) {
      const int rc = io_uring_submit(&ring_);
      if (rc >= 0 || (rc != -EINTR && rc != -EAGAIN && rc != -EBUSY)) return;
    }
  }
  void reap(std::vector<std::pair<uint32_t, int64_t>>& out) override {
    if (!failed_.empty()) {
      out.insert(out.end(), failed_.begin(), failed_.end());
      failed_.clear();
      return;
    }
    io_uring_cqe* cqe = nullptr;
    int rc;
    do {
      rc = io_uring_wait_cqe(&ring_, &cqe);
    } while (rc == -EINTR);
    if (rc < 0) return;
    unsigned head;
    unsigned count = 0;
    io_uring_for_each_cqe(&ring_, head, cqe) {
      const auto slot = static_cast<uint32_t>(reinterpret_cast<uintptr_t>(io_uring_cqe_get_data(cqe)));
      out.emplace_back(slot, static_cast<int64_t>(cqe->res));
      ++count;
    }
    io_uring_cq_advance(&ring_, count);
  }

 private:
  int depth_;
  io_uring ring_;
  bool disabled_;
  int enable_error_ = 0;
  std::vector<std::pair<uint32_t, int64_t>> failed_;
};

// Setup flags, best first: completions run only when the worker waits for them (Linux 6.1+), or at least
// without interrupting it (5.19+), or the default.
constexpr unsigned kUringFlags[] = {
    IORING_SETUP_R_DISABLED | IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN,
    IORING_SETUP_COOP_TASKRUN,
    0,
};

std::unique_ptr<Ring> make_uring(int depth, std::string& why) {
  io_uring ring;
  int rc = -EINVAL;
  unsigned flags = 0;
  for (unsigned candidate : kUringFlags) {
    std::memset(&ring, 0, sizeof(ring));
    flags = candidate;
    rc = io_uring_queue_init(static_cast<unsigned>(depth), &ring, flags);
    if (rc != -EINVAL) break;  // EINVAL: flags this kernel does not know
  }
  if (rc < 0) {
    why = std::string("io_uring_queue_init failed: ") + std::strerror(-rc) +
          (rc == -EPERM ? " (io_uring disabled by sysctl kernel.io_uring_disabled or a seccomp profile)" : "");
    return nullptr;
  }
  // IORING_OP_READ / WRITE came with Linux 5.6; an older kernel would fail every transfer with EINVAL.
  io_uring_probe* probe = io_uring_get_probe();
  const bool usable = probe != nullptr && io_uring_opcode_supported(probe, IORING_OP_READ) &&
                      io_uring_opcode_supported(probe, IORING_OP_WRITE);
  if (probe != nullptr) io_uring_free_probe(probe);
  if (!usable) {
    io_uring_queue_exit(&ring);
    why = "this kernel's io_uring has no IORING_OP_READ/WRITE (Linux >= 5.6 needed)";
    return nullptr;
  }
  return std::make_unique<UringRing>(depth, ring, (flags & IORING_SETUP_R_DISABLED) != 0);
}
#endif

#if defined(SLIPSTREAM_AIO_HAVE_LIBAIO) || defined(SLIPSTREAM_AIO_KERNEL_AIO)
#ifdef SLIPSTREAM_AIO_HAVE_LIBAIO
using AioContext = io_context_t;
#else
using AioContext = aio_context_t;
#endif

// What the "libaio" engine does the same way through libaio and through the raw system calls: the control
// blocks and events of `depth` slots, the queue of prepared blocks, and submission, where a block the kernel
// refuses is reported by the next reap() and the others still go.
class AioRing : public Ring {
 public:
  AioRing(int depth, AioContext ctx)
      : depth_(depth), ctx_(ctx), iocbs_(static_cast<size_t>(depth)), events_(static_cast<size_t>(depth)) {}
  int depth() const override { return depth_; }
  void submit() final {
    size_t at = 0;
    while (at < queued_.size()) {
      const long rc = submit_from(at);
      if (rc == -EINTR || rc == -EAGAIN) continue;
      if (rc < 0) {  // the first remaining iocb was refused: report it, go on with the others
        failed_.emplace_back(slot_of(*queued_[at]), rc);
        ++at;
        continue;
      }
      at += static_cast<size_t>(rc);
    }
    queued_.clear();
  }
  void reap(std::vector<std::pair<uint32_t, int64_t>>& out) final {
    if (!failed_.empty()) {
      out.insert(out.end(), failed_.begin(), failed_.end());
      failed_.clear();
      return;
    }
    reap_events(out);
  }

 protected:
  // Hand queued_[at..] to the kernel: how many blocks it took, or -errno.
  virtual long submit_from(size_t at) = 0;
  virtual uint32_t slot_of(const iocb& cb) const = 0;
  // Wait for at least one completion; append (slot, bytes or -errno) of each.
  virtual void reap_events(std::vector<std::pair<uint32_t, int64_t>>& out) = 0;

  int depth_;
  AioContext ctx_;
  std::vector<iocb> iocbs_;
  std::vector<io_event> events_;
  std::vector<iocb*> queued_;

 private:
  std::vector<std::pair<uint32_t, int64_t>> failed_;
};
#endif

#ifdef SLIPSTREAM_AIO_HAVE_LIBAIO
class LibaioRing final : public AioRing {
 public:
  using AioRing::AioRing;
  ~LibaioRing() override { io_destroy(ctx_); }
  void prepare(uint32_t slot, bool is_read, int fd, char* buf, int64_t len, int64_t offset) override {
    iocb* cb = &iocbs_[slot];
    if (is_read) {
      io_prep_pread(cb, fd, buf, static_cast<size_t>(len), offset);
    } else {
      io_prep_pwrite(cb, fd, buf, static_cast<size_t>(len), offset);
    }
    cb->data = reinterpret_cast<void*>(static_cast<uintptr_t>(slot));
    queued_.push_back(cb);
  }

 private:
  long submit_from(size_t at) override {
    return io_submit(ctx_, static_cast<long>(queued_.size() - at), queued_.data() + at);
  }
  uint32_t slot_of(const iocb& cb) const override {
    return static_cast<uint32_t>(reinterpret_cast<uintptr_t>(cb.data));
  }
  void reap_events(std::vector<std::pair<uint32_t, int64_t>>& out) override {
    int n;
    do {
      n = io_getevents(ctx_, 1, depth_, events_.data(), nullptr);
    } while (n == -EINTR);
    for (int i = 0; i < n; ++i) {
      const io_event& ev = events_[static_cast<size_t>(i)];
      const auto slot = static_cast<uint32_t>(reinterpret_cast<uintptr_t>(ev.obj->data));
      out.emplace_back(slot, static_cast<int64_t>(static_cast<long>(ev.res)));
    }
  }
};

std::unique_ptr<Ring> make_libaio(int depth, std::string& why) {
  io_context_t ctx = nullptr;
  const int rc = io_setup(depth, &ctx);
  if (rc < 0) {
    why = std::string("io_setup failed: ") + std::strerror(-rc) +
          (rc == -EAGAIN ? " (fs.aio-max-nr reached; lower queue_depth or raise the sysctl)" : "");
    return nullptr;
  }
  return std::make_unique<LibaioRing>(depth, ctx);
}
#elif defined(SLIPSTREAM_AIO_KERNEL_AIO)
// The same kernel interface libaio wraps, called through syscall(2): io_setup, io_submit, io_getevents and
// io_destroy with the structures of <linux/aio_abi.h>. Errors come back as -1 and errno (libaio returns
// -errno); they are turned into -errno here so the worker sees the same values.
class KernelAioRing final : public AioRing {
 public:
  using AioRing::AioRing;
  ~KernelAioRing() override { syscall(__NR_io_destroy, ctx_); }
  void prepare(uint32_t slot, bool is_read, int fd, char* buf, int64_t len, int64_t offset) override {
    iocb* cb = &iocbs_[slot];
    std::memset(cb, 0, sizeof(*cb));
    cb->aio_lio_opcode = is_read ? IOCB_CMD_PREAD : IOCB_CMD_PWRITE;
    cb->aio_fildes = static_cast<uint32_t>(fd);
    cb->aio_buf = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(buf));
    cb->aio_nbytes = static_cast<uint64_t>(len);
    cb->aio_offset = offset;
    cb->aio_data = slot;
    queued_.push_back(cb);
  }

 private:
  long submit_from(size_t at) override {
    const long rc = syscall(__NR_io_submit, ctx_, static_cast<long>(queued_.size() - at), queued_.data() + at);
    if (rc < 0) return -errno;
    return rc == 0 ? -EIO : rc;  // taking none is a refusal of the first block
  }
  uint32_t slot_of(const iocb& cb) const override { return static_cast<uint32_t>(cb.aio_data); }
  void reap_events(std::vector<std::pair<uint32_t, int64_t>>& out) override {
    long n;
    do {
      n = syscall(__NR_io_getevents, ctx_, 1L, static_cast<long>(depth_), events_.data(), nullptr);
    } while (n < 0 && errno == EINTR);
    for (long i = 0; i < n; ++i) {
      const io_event& ev = events_[static_cast<size_t>(i)];
      out.emplace_back(static_cast<uint32_t>(ev.data), static_cast<int64_t>(ev.res));
    }
  }
};

std::unique_ptr<Ring> make_libaio(int depth, std::string& why) {
  aio_context_t ctx = 0;
  if (syscall(__NR_io_setup, static_cast<unsigned>(depth), &ctx) < 0) {
    const int err = errno;
    why = std::string("io_setup failed: ") + std::strerror(err) +
          (err == EAGAIN ? " (fs.aio-max-nr reached; lower queue_depth or raise the sysctl)" : "");
    return nullptr;
  }
  return std::make_unique<KernelAioRing>(depth, ctx);
}
#endif

}  // namespace

// libaio first: DeepSpeed's engine, and on ext4 it was as fast as io_uring on large transfers and faster on
// small new-file writes (io_uring retries those from a kernel worker thread after the first attempt would
// have blocked on the file's mtime update). io_uring next (seccomp profiles that refuse io_setup are rare,
// so this mostly serves builds with liburing only), then threads.
std::vector<std::string> compiled_engines() {
  std::vector<std::string> kinds;
#if defined(SLIPSTREAM_AIO_HAVE_LIBAIO) || defined(SLIPSTREAM_AIO_KERNEL_AIO)
  kinds.emplace_back("libaio");
#endif
#ifdef SLIPSTREAM_AIO_HAVE_URING
  kinds.emplace_back("io_uring");
#endif
  kinds.emplace_back("sync");
  return kinds;
}

std::unique_ptr<Ring> make_ring(const std::string& kind, int depth, std::string& why) {
#ifdef SLIPSTREAM_AIO_HAVE_URING
  if (kind == "io_uring") return make_uring(depth, why);
#endif
#if defined(SLIPSTREAM_AIO_HAVE_LIBAIO) || defined(SLIPSTREAM_AIO_KERNEL_AIO)
  if (kind == "libaio") return make_libaio(depth, why);
#endif
  if (kind == "sync") return std::make_unique<SyncRing>(depth);
  why = "not compiled into this build (compiled: ";
  for (const auto& k : compiled_engines()) why += k + " ";
  why.back() = ')';
  return nullptr;
}

}  // namespace slipstream_aio
