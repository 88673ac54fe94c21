// torchpp._timer: monotonic nanosecond spans recorded into a preallocated buffer.
//
// Hooks call into this from the Python thread (forward) and from the autograd engine's
// thread (backward). Each record reserves its slot with one atomic fetch_add, so the hot
// path takes no lock and never allocates. Records beyond the capacity are counted as
// dropped (never silently lost); Python reads everything back in one call as an
// int64 array of shape [n, 3] = (id, start_ns, end_ns).
//
// Only pybind11 is included (not torch/extension.h): the extension does not touch tensors,
// and the small include keeps the build to a few seconds on a slow host.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>

namespace py = pybind11;

namespace {

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

constexpr int64_t kOpen = -1;  // end time of a span whose end() has not run yet

class SpanTimer {
 public:
  explicit SpanTimer(int64_t capacity) : capacity_(capacity) {
    if (capacity <= 0) throw std::invalid_argument("SpanTimer: capacity must be > 0, got " + std::to_string(capacity));
    data_.reset(new int64_t[static_cast<size_t>(capacity) * 3]);
    std::memset(data_.get(), 0, sizeof(int64_t) * static_cast<size_t>(capacity) * 3);
  }

  // Start a span: returns its slot (pass it to end()), or -1 when the buffer is full.
  int64_t begin(int64_t id) {
    int64_t t = now_ns();
    int64_t slot = reserve();
    if (slot >= 0) write(slot, id, t, kOpen);
    return slot;
  }

  // Close the span begun in `slot`; returns its end time (0 for a dropped slot).
  int64_t end(int64_t slot) {
    int64_t t = now_ns();
    if (slot < 0) return 0;
    if (slot >= capacity_) throw std::out_of_range("SpanTimer.end: slot " + std::to_string(slot) + " out of range");
    data_[slot * 3 + 2] = t;
    return t;
  }

  // A span measured elsewhere (both times from now_ns()).
  int64_t record(int64_t id, int64_t t0, int64_t t1) {
    int64_t slot = reserve();
    if (slot >= 0) write(slot, id, t0, t1);
    return slot;
  }

  // An instant: start == end == now. Returns the time.
  int64_t mark(int64_t id) {
    int64_t t = now_ns();
    int64_t slot = reserve();
    if (slot >= 0) write(slot, id, t, t);
    return t;
  }

  int64_t count() const { return std::min(next_.load(std::memory_order_acquire), capacity_); }
  int64_t dropped() const { return std::max<int64_t>(0, next_.load(std::memory_order_acquire) - capacity_); }
  int64_t capacity() const { return capacity_; }
  void reset() { next_.store(0, std::memory_order_release); }

  // Copy of the recorded rows, shape [count, 3]: (id, start_ns, end_ns); end_ns is -1 while open.
  py::array_t<int64_t> read() const {
    int64_t n = count();
    py::array_t<int64_t> out({static_cast<py::ssize_t>(n), static_cast<py::ssize_t>(3)});
    if (n > 0) std::memcpy(out.mutable_data(), data_.get(), sizeof(int64_t) * static_cast<size_t>(n) * 3);
    return out;
  }

 private:
  int64_t reserve() {
    int64_t slot = next_.fetch_add(1, std::memory_order_acq_rel);
    return slot < capacity_ ? slot : -1;
  }
  void write(int64_t slot, int64_t id, int64_t t0, int64_t t1) {
    int64_t* row = data_.get() + slot * 3;
    row[0] = id;
    row[1] = t0;
    row[2] = t1;
  }

  const int64_t capacity_;
  std::unique_ptr<int64_t[]> data_;
  std::atomic<int64_t> next_{0};
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Monotonic (steady_clock) nanosecond span timer with a preallocated, lock-free buffer";
  m.def("now_ns", &now_ns, "steady_clock time in nanoseconds");
  py::class_<SpanTimer>(m, "SpanTimer")
      .def(py::init<int64_t>(), py::arg("capacity"))
      .def("begin", &SpanTimer::begin, py::arg("id"))
      .def("end", &SpanTimer::end, py::arg("slot"))
      .def("record", &SpanTimer::record, py::arg("id"), py::arg("start_ns"), py::arg("end_ns"))
      .def("mark", &SpanTimer::mark, py::arg("id"))
      .def("count", &SpanTimer::count)
      .def("dropped", &SpanTimer::dropped)
      .def("capacity", &SpanTimer::capacity)
      .def("reset", &SpanTimer::reset)
      .def("read", &SpanTimer::read);
}
