// Native async_io op (`slipstream_async_io`): DeepSpeed's `aio_handle` face over the engine in aio_engine.cpp.
//
// Interface (slipstream/ops/fallback/async_io.py has the same):
//   aio_handle(block_size=1048576, queue_depth=128, single_submit=False, overlap_events=True,
//              intra_op_parallelism=1)
//     .async_pread(tensor, filename, file_offset=0) -> 0      .async_pwrite(tensor, filename, file_offset=0) -> 0
//     .sync_pread(...) / .sync_pwrite(...) -> completed count  .wait() -> completed count (raises AsyncIOError)
//     .new_cpu_locked_tensor(num_elem, example_tensor)        .free_cpu_locked_tensor(tensor) -> bool
//     .get_block_size() .get_queue_depth() .get_single_submit() .get_overlap_events()
//     .get_intra_op_parallelism() .get_alignment() .engine()
//   engines() -> engines compiled in, in order of preference
// Environment, read when a handle is made: SLIPSTREAM_AIO_ENGINE=auto|io_uring|libaio|sync,
// SLIPSTREAM_AIO_DIRECT=0 (no O_DIRECT).
#include <torch/extension.h>

#include <sys/mman.h>

#include <cstdlib>
#include <mutex>
#include <tuple>
#include <unordered_set>

#include "aio_engine.h"

namespace py = pybind11;
using slipstream_aio::Config;
using slipstream_aio::Engine;
using slipstream_aio::IoFailure;

namespace {

std::string env_or(const char* name, const char* fallback) {
  const char* value = std::getenv(name);
  return value != nullptr && value[0] != '\0' ? std::string(value) : std::string(fallback);
}

char* checked_data(const at::Tensor& t, const char* method) {
  if (!t.device().is_cpu()) {
    throw std::invalid_argument(std::string("aio_handle.") + method + ": the tensor is on " + t.device().str() +
                                "; async_io moves CPU tensors (copy to a pinned host buffer first)");
  }
  if (!t.is_contiguous()) {
    throw std::invalid_argument(std::string("aio_handle.") + method + ": the tensor (shape " +
                                c10::str(t.sizes()) + ") is not contiguous; pass tensor.contiguous()");
  }
  return static_cast<char*>(t.data_ptr());
}

std::shared_ptr<void> keep(const at::Tensor& t) {
  return std::shared_ptr<void>(new at::Tensor(t), [](void* p) { delete static_cast<at::Tensor*>(p); });
}

std::string path_string(const py::object& filename) {
  return py::str(py::module_::import("os").attr("fspath")(filename));
}

class AioHandle {
 public:
  AioHandle(int64_t block_size, int64_t queue_depth, bool single_submit, bool overlap_events,
            int64_t intra_op_parallelism)
      : engine_(make_config(block_size, queue_depth, single_submit, overlap_events, intra_op_parallelism)) {}

  int64_t submit(bool is_read, const at::Tensor& t, const py::object& filename, int64_t offset, bool then_wait) {
    const char* method = is_read ? (then_wait ? "sync_pread" : "async_pread")
                                 : (then_wait ? "sync_pwrite" : "async_pwrite");
    char* data = checked_data(t, method);
    const std::string path = path_string(filename);
    py::gil_scoped_release release;
    engine_.submit(is_read, data, static_cast<int64_t>(t.nbytes()), path, offset, keep(t));
    return then_wait ? engine_.wait() : 0;
  }

  int64_t wait() {
    py::gil_scoped_release release;
    return engine_.wait();
  }

  at::Tensor new_cpu_locked_tensor(int64_t num_elem, const at::Tensor& example) {
    if (num_elem < 0) throw std::invalid_argument("new_cpu_locked_tensor: num_elem must be >= 0");
    const auto elem = static_cast<int64_t>(example.element_size());
    const int64_t bytes = std::max<int64_t>(num_elem * elem, 1);
    const int64_t rounded = (bytes + slipstream_aio::kAlignment - 1) / slipstream_aio::kAlignment *
                            slipstream_aio::kAlignment;
    void* p = nullptr;
    if (posix_memalign(&p, static_cast<size_t>(slipstream_aio::kAlignment), static_cast<size_t>(rounded)) != 0) {
      throw std::runtime_error("new_cpu_locked_tensor: cannot allocate " + std::to_string(rounded) +
                               " bytes of page-aligned host memory");
    }
    // Best effort: without CAP_IPC_LOCK or with a small RLIMIT_MEMLOCK the pages stay pageable, which
    // O_DIRECT does not need.
    const bool locked = mlock(p, static_cast<size_t>(rounded)) == 0;
    auto deleter = [rounded, locked](void* q) {
      if (locked) munlock(q, static_cast<size_t>(rounded));
      std::free(q);
    };
    at::Tensor t = torch::from_blob(p, {num_elem}, deleter, example.options().device(at::kCPU).requires_grad(false));
    std::lock_guard<std::mutex> lock(locked_mutex_);
    locked_.insert(p);
    return t;
  }

  bool free_cpu_locked_tensor(at::Tensor& t) {
    {
      std::lock_guard<std::mutex> lock(locked_mutex_);
      if (locked_.erase(t.data_ptr()) == 0) return false;
    }
    t.set_();  // the Python tensor becomes empty; the memory goes when its last view does
    return true;
  }

  const Config& config() const { return engine_.config(); }
  const std::string& engine_name() const { return engine_.engine_name(); }

 private:
  static Config make_config(int64_t block_size, int64_t queue_depth, bool single_submit, bool overlap_events,
                            int64_t intra_op_parallelism) {
    if (block_size <= 0 || block_size > (int64_t{1} << 30) || queue_depth <= 0 || queue_depth > 4096 ||
        intra_op_parallelism <= 0 || intra_op_parallelism > 256) {
      throw std::invalid_argument("aio_handle: block_size must be in [1, 2**30], queue_depth in [1, 4096] and "
                                  "intra_op_parallelism in [1, 256] (got " + std::to_string(block_size) + ", " +
                                  std::to_string(queue_depth) + ", " + std::to_string(intra_op_parallelism) + ")");
    }
    Config cfg;
    cfg.block_size = block_size;
    cfg.queue_depth = static_cast<int>(queue_depth);
    cfg.single_submit = single_submit;
    cfg.overlap_events = overlap_events;
    cfg.intra_op_parallelism = static_cast<int>(intra_op_parallelism);
    cfg.engine = env_or("SLIPSTREAM_AIO_ENGINE", "auto");
    cfg.use_direct = env_or("SLIPSTREAM_AIO_DIRECT", "1") != "0";
    return cfg;
  }

  Engine engine_;
  std::mutex locked_mutex_;
  std::unordered_set<void*> locked_;
};

void translate_failure(std::exception_ptr p) {
  try {
    if (p) std::rethrow_exception(p);
  } catch (const IoFailure& e) {
    try {
      py::object cls = py::module_::import("slipstream.ops.aio.errors").attr("AsyncIOError");
      py::object at = e.at >= 0 ? py::object(py::int_(e.at)) : py::object(py::none());
      py::object exc = cls(e.err, e.operation, e.filename, e.offset, e.size, e.detail, py::arg("at") = at,
                           py::arg("num_failed") = e.num_failed);
      PyErr_SetObject(cls.ptr(), exc.ptr());
    } catch (py::error_already_set& inner) {
      inner.restore();
    }
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::register_exception_translator(&translate_failure);
  m.def("engines", &slipstream_aio::compiled_engines, "I/O engines compiled in, in order of preference");
  py::class_<AioHandle> handle(m, "aio_handle");
  handle.def(py::init<int64_t, int64_t, bool, bool, int64_t>(), py::arg("block_size") = 1048576,
             py::arg("queue_depth") = 128, py::arg("single_submit") = false, py::arg("overlap_events") = true,
             py::arg("intra_op_parallelism") = 1);
  // The four transfers: (name, is_read, wait for completion).
  const std::tuple<const char*, bool, bool> transfers[] = {
      {"async_pread", true, false},
      {"async_pwrite", false, false},
      {"sync_pread", true, true},
      {"sync_pwrite", false, true},
  };
  for (const auto& [name, is_read, sync] : transfers) {
    handle.def(
        name,
        [is_read = is_read, sync = sync](AioHandle& h, const at::Tensor& t, const py::object& f, int64_t off) {
          return h.submit(is_read, t, f, off, sync);
        },
        py::arg("buffer"), py::arg("filename"), py::arg("file_offset") = 0);
  }
  handle
      .def("wait", &AioHandle::wait)
      .def("new_cpu_locked_tensor", &AioHandle::new_cpu_locked_tensor, py::arg("num_elem"),
           py::arg("example_tensor"))
      .def("free_cpu_locked_tensor", &AioHandle::free_cpu_locked_tensor, py::arg("tensor"))
      .def("get_block_size", [](const AioHandle& h) { return h.config().block_size; })
      .def("get_queue_depth", [](const AioHandle& h) { return h.config().queue_depth; })
      .def("get_single_submit", [](const AioHandle& h) { return h.config().single_submit; })
      .def("get_overlap_events", [](const AioHandle& h) { return h.config().overlap_events; })
      .def("get_intra_op_parallelism", [](const AioHandle& h) { return h.config().intra_op_parallelism; })
      .def("get_alignment", [](const AioHandle&) { return slipstream_aio::kAlignment; })
      .def("engine", &AioHandle::engine_name);
}
