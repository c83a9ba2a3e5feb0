// flashckpt's per-tensor hot path in C++: the walk of an unchanged state dict against its cached
// skeleton, the structure of a tensor list (a snapshot's signature) and the copies of many small
// storages, without a Python call per item.
//
// Built on first use by flashckpt_core._native (torch.utils.cpp_extension); flashckpt runs the same
// logic in Python wherever this cannot be built.
#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <unordered_map>
#include <vector>

namespace py = pybind11;

namespace {

void put(std::string& out, int64_t v) { out.append(reinterpret_cast<const char*>(&v), sizeof(v)); }

struct PairHash {
  size_t operator()(const std::pair<int64_t, int64_t>& p) const {
    return std::hash<int64_t>()(p.first) * 1000003u ^ std::hash<int64_t>()(p.second);
  }
};

// The dispatch keys of the tensors scan refuses (nested, zero tensors) or flags (conjugate and negative bits).
constexpr c10::DispatchKeySet kUnusual =
    c10::DispatchKeySet(c10::DispatchKey::Conjugate) | c10::DispatchKeySet(c10::DispatchKey::Negative) |
    c10::DispatchKeySet(c10::DispatchKey::ZeroTensor) | c10::DispatchKeySet(c10::DispatchKey::NestedTensor);

}  // namespace

// For each tensor: dtype, device index (-1: CPU), flags (requires_grad 1, conjugate bit 2, negative bit 4:
// the bits change the values its bytes stand for), is-Parameter, storage offset, storage bytes, storage
// sharing group (-1: empty storage), ndim, sizes, strides; packed as int64s. Returns (signature bytes,
// storage data pointers as int64 bytes, index of the first tensor flashckpt cannot store or -1). Two lists
// with equal signatures lay out alike in a snapshot.
py::tuple scan(const py::list& tensors, const py::handle& parameter_type) {
  const auto n = static_cast<int64_t>(tensors.size());
  std::string sig;
  sig.reserve(static_cast<size_t>(n) * 12 * sizeof(int64_t));
  std::string ptrs;
  ptrs.reserve(static_cast<size_t>(n) * sizeof(int64_t));
  std::unordered_map<std::pair<int64_t, int64_t>, int64_t, PairHash> groups;
  PyObject* tensor_type = reinterpret_cast<PyObject*>(THPVariableClass);
  for (int64_t i = 0; i < n; ++i) {
    PyObject* obj = PyList_GET_ITEM(tensors.ptr(), i);
    PyObject* type = reinterpret_cast<PyObject*>(Py_TYPE(obj));
    const bool is_param = type == parameter_type.ptr();
    if (!THPVariable_Check(obj) || (type != tensor_type && !is_param)) {
      return py::make_tuple(py::bytes(), py::bytes(), i);
    }
    const at::Tensor& t = THPVariable_Unpack(obj);
    if (t.layout() != at::kStrided || t.is_meta() || t.is_quantized()) {
      return py::make_tuple(py::bytes(), py::bytes(), i);
    }
    int64_t flags = t.requires_grad() ? 1 : 0;
    if (t.key_set().has_any(kUnusual)) {  // one test for what ordinary tensors never carry
      if (t.is_nested() || t._is_zerotensor()) {
        return py::make_tuple(py::bytes(), py::bytes(), i);  // no plain storage
      }
      flags |= (t.is_conj() ? 2 : 0) | (t.is_neg() ? 4 : 0);
    }
    const auto& st = t.storage();
    const auto nbytes = static_cast<int64_t>(st.nbytes());
    const auto ptr = reinterpret_cast<int64_t>(st.data());
    const int64_t dev = t.is_cpu() ? -1 : static_cast<int64_t>(t.get_device());
    int64_t group = -1;
    if (nbytes) {
      group = groups.emplace(std::make_pair(dev, ptr), static_cast<int64_t>(groups.size())).first->second;
    }
    put(ptrs, ptr);
    put(sig, static_cast<int64_t>(t.scalar_type()));
    put(sig, dev);
    put(sig, flags);
    put(sig, is_param ? 1 : 0);
    put(sig, t.storage_offset());
    put(sig, nbytes);
    put(sig, group);
    put(sig, t.dim());
    for (auto s : t.sizes()) put(sig, s);
    for (auto s : t.strides()) put(sig, s);
  }
  return py::make_tuple(py::bytes(sig), py::bytes(ptrs), -1);
}

namespace {

// _tree.flatten_like's ``match`` in C: the same rules, in the same order (see there).
class Matcher {
 public:
  Matcher(PyObject* param_type, PyObject* odict_type, PyObject* tensors)
      : param_t_(param_type), odict_t_(odict_type), tensors_(tensors) {}

  // 1: ``x`` matches ``sk`` (its tensors appended), 0: it does not, -1: a Python error is set.
  int match(PyObject* x, PyObject* sk) {
    PyTypeObject* tx = Py_TYPE(x);
    if (is_tensor(tx)) return tensor(x, sk);
    if (tx == &PyUnicode_Type || tx == &PyLong_Type || x == Py_None) {
      if (Py_TYPE(sk) != tx) return 0;
      return PyObject_RichCompareBool(sk, x, Py_EQ);
    }
    if (!PyList_CheckExact(sk) || PyList_GET_SIZE(sk) < 2) return 0;
    PyObject* tag = PyList_GET_ITEM(sk, 0);
    PyObject* body = PyList_GET_ITEM(sk, 1);
    const bool od = reinterpret_cast<PyObject*>(tx) == odict_t_;
    if (tx == &PyDict_Type || od) {
      if (!is(tag, od ? "od" : "d") || !PyList_CheckExact(body) || PyList_GET_SIZE(body) != PyDict_Size(x)) return 0;
      const int r = od ? ordered_items(x, body) : dict_items(x, body);
      if (r != 1 || !od) return r;
      PyObject* md = PyObject_GetAttrString(x, "_metadata");
      if (md == nullptr) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return -1;
        PyErr_Clear();
      } else if (md == Py_None) {  // as getattr(x, "_metadata", None) is None
        Py_DECREF(md);
        md = nullptr;
      }
      const Py_ssize_t n = PyList_GET_SIZE(sk);
      if ((md == nullptr) != (n == 2)) {
        Py_XDECREF(md);
        return 0;
      }
      if (md == nullptr) return 1;
      const int m = match(md, PyList_GET_ITEM(sk, 2));
      Py_DECREF(md);
      return m;
    }
    if (tx == &PyList_Type || tx == &PyTuple_Type) {
      const bool list = tx == &PyList_Type;
      if (!is(tag, list ? "l" : "t") || !PyList_CheckExact(body)) return 0;
      const Py_ssize_t n = list ? PyList_GET_SIZE(x) : PyTuple_GET_SIZE(x);
      if (PyList_GET_SIZE(body) != n) return 0;
      for (Py_ssize_t i = 0; i < n; ++i) {
        const int r = match(list ? PyList_GET_ITEM(x, i) : PyTuple_GET_ITEM(x, i), PyList_GET_ITEM(body, i));
        if (r != 1) return r;
      }
      return 1;
    }
    if (tx == &PyFloat_Type) {
      if (!is(tag, "f")) return 0;
      const double d = PyFloat_AS_DOUBLE(x);
      if (std::isnan(d)) {  // "nan:" and its 8 bytes, big-endian (_tree._nan_code): float.hex drops them
        uint64_t u;
        std::memcpy(&u, &d, sizeof(u));
        char code[32];
        std::snprintf(code, sizeof(code), "nan:%016llx", static_cast<unsigned long long>(u));
        return PyUnicode_CheckExact(body) && PyUnicode_CompareWithASCIIString(body, code) == 0 ? 1 : 0;
      }
      PyObject* hex = PyObject_CallMethod(x, "hex", nullptr);
      if (hex == nullptr) return -1;
      const int r = PyObject_RichCompareBool(body, hex, Py_EQ);
      Py_DECREF(hex);
      return r;
    }
    if (tx == &PyBool_Type) return is(tag, "B") && body == x ? 1 : 0;
    return 0;  // bytes, dtypes, opaque leaves, ...: the full walk
  }

 private:
  bool is_tensor(PyTypeObject* t) const {
    return reinterpret_cast<PyObject*>(t) == reinterpret_cast<PyObject*>(THPVariableClass) ||
           reinterpret_cast<PyObject*>(t) == param_t_;
  }

  static bool is(PyObject* tag, const char* s) {
    return PyUnicode_CheckExact(tag) && PyUnicode_CompareWithASCIIString(tag, s) == 0;
  }

  // A tensor leaf: the skeleton holds ["T", its index in traversal order].
  int tensor(PyObject* x, PyObject* sk) {
    if (!PyList_CheckExact(sk) || PyList_GET_SIZE(sk) < 2 || !is(PyList_GET_ITEM(sk, 0), "T")) return 0;
    PyObject* idx = PyList_GET_ITEM(sk, 1);
    if (!PyLong_CheckExact(idx) || PyLong_AsSsize_t(idx) != PyList_GET_SIZE(tensors_)) {
      PyErr_Clear();
      return 0;
    }
    return PyList_Append(tensors_, x) == 0 ? 1 : -1;
  }

  // One (key, value) against its skeleton pair [key, value skeleton].
  int item(PyObject* k, PyObject* v, PyObject* pair) {
    if (!(PyList_CheckExact(pair) || PyTuple_CheckExact(pair)) || PySequence_Fast_GET_SIZE(pair) != 2) return 0;
    PyObject* sk_key = PySequence_Fast_GET_ITEM(pair, 0);
    PyTypeObject* tk = Py_TYPE(k);
    if (!(tk == &PyUnicode_Type || tk == &PyLong_Type || k == Py_None) || Py_TYPE(sk_key) != tk) return 0;
    const int eq = PyObject_RichCompareBool(sk_key, k, Py_EQ);
    if (eq != 1) return eq;
    return match(v, PySequence_Fast_GET_ITEM(pair, 1));
  }

  int dict_items(PyObject* x, PyObject* body) {
    Py_ssize_t pos = 0, i = 0;
    PyObject *k, *v;
    while (PyDict_Next(x, &pos, &k, &v)) {  // insertion order, as dict.items()
      const int r = item(k, v, PyList_GET_ITEM(body, i++));
      if (r != 1) return r;
    }
    return 1;
  }

  int ordered_items(PyObject* x, PyObject* body) {  // OrderedDict: its own order (move_to_end)
    PyObject* items = PyObject_CallMethod(x, "items", nullptr);
    if (items == nullptr) return -1;
    PyObject* it = PyObject_GetIter(items);
    Py_DECREF(items);
    if (it == nullptr) return -1;
    int r = 1;
    Py_ssize_t i = 0;
    while (PyObject* kv = PyIter_Next(it)) {
      r = i < PyList_GET_SIZE(body) ? item(PyTuple_GET_ITEM(kv, 0), PyTuple_GET_ITEM(kv, 1), PyList_GET_ITEM(body, i++))
                                    : 0;
      Py_DECREF(kv);
      if (r != 1) break;
    }
    Py_DECREF(it);
    if (r == 1 && PyErr_Occurred()) r = -1;
    return r;
  }

  PyObject* param_t_;
  PyObject* odict_t_;
  PyObject* tensors_;
};

}  // namespace

// The tensors of ``obj`` in traversal order when it has exactly the structure and plain leaves of
// ``skeleton`` (a skeleton _tree.flatten made), else None: _tree.flatten_like without the tensor checks
// (scan makes them).
py::object flatten_like(const py::handle& obj, const py::handle& skeleton, const py::handle& parameter_type,
                        const py::handle& odict_type) {
  py::list tensors;
  Matcher m(parameter_type.ptr(), odict_type.ptr(), tensors.ptr());
  const int r = m.match(obj.ptr(), skeleton.ptr());
  if (r < 0) throw py::error_already_set();
  return r == 1 ? py::object(tensors) : py::object(py::none());
}

// Copies the storages of a plan: for every (tensor index, destination offset, bytes) triple in
// ``copies`` (int64s), ``bytes`` from ``ptrs[index]`` to ``dst_base + offset``. The GIL is released.
namespace {

// A plan's copies: the storage addresses (int64s) and the (tensor index, offset, bytes) triples, checked.
struct PlanCopies {
  const int64_t* src;
  const int64_t* cp;
  size_t count;
};

PlanCopies plan_copies(const py::bytes& ptrs, const py::bytes& copies, const char* what) {
  std::string_view p = ptrs;
  std::string_view c = copies;
  PlanCopies out{reinterpret_cast<const int64_t*>(p.data()), reinterpret_cast<const int64_t*>(c.data()),
                 c.size() / (3 * sizeof(int64_t))};
  const size_t nsrc = p.size() / sizeof(int64_t);
  for (size_t k = 0; k < out.count; ++k) {
    if (static_cast<size_t>(out.cp[3 * k]) >= nsrc) throw std::out_of_range(std::string(what) + ": tensor index out of range");
  }
  return out;
}

}  // namespace

void copy_storages(int64_t dst_base, const py::bytes& ptrs, const py::bytes& copies) {
  const auto [src, cp, count] = plan_copies(ptrs, copies, "copy_storages");
  py::gil_scoped_release release;
  auto* dst = reinterpret_cast<char*>(dst_base);
  for (size_t k = 0; k < count; ++k) {
    std::memcpy(dst + cp[3 * k + 1], reinterpret_cast<const char*>(src[cp[3 * k]]), static_cast<size_t>(cp[3 * k + 2]));
  }
}

// The CUDA runtime's cudaMemcpyAsync, as torch loaded it (its address comes from Python: no CUDA header or
// library is needed to build this file, and the runtime is the very one torch's streams belong to).
using MemcpyAsync = int (*)(void* dst, const void* src, size_t n, int kind, void* stream);

// Queues the copies of a plan with cudaMemcpyAsync(fn) on ``stream`` (kind: 2 device-to-host, 1
// host-to-device): for every (tensor index, offset, bytes) triple in ``copies``, ``bytes`` between
// ``ptrs[index]`` and ``base + offset``. One call for a snapshot's hundreds of CUDA tensors, the GIL released.
// Returns (-1, 0), or (the index of the triple the runtime refused, its error code): the copies before it
// are queued.
py::tuple memcpy_async(int64_t fn, int64_t stream, int64_t base, const py::bytes& ptrs, const py::bytes& copies,
                       int64_t kind) {
  const auto [src, cp, count] = plan_copies(ptrs, copies, "memcpy_async");
  if (fn == 0) throw std::invalid_argument("memcpy_async: no cudaMemcpyAsync");
  auto copy = reinterpret_cast<MemcpyAsync>(fn);
  auto* s = reinterpret_cast<void*>(stream);
  auto* host = reinterpret_cast<char*>(base);
  const int k_kind = static_cast<int>(kind);
  int64_t failed = -1;
  int code = 0;
  {
    py::gil_scoped_release release;
    for (size_t k = 0; k < count; ++k) {
      auto* dev = reinterpret_cast<char*>(src[cp[3 * k]]);
      auto* h = host + cp[3 * k + 1];
      const auto n = static_cast<size_t>(cp[3 * k + 2]);
      code = k_kind == 2 ? copy(h, dev, n, k_kind, s) : copy(dev, h, n, k_kind, s);
      if (code != 0) {
        failed = static_cast<int64_t>(k);
        break;
      }
    }
  }
  return py::make_tuple(failed, code);
}

// cudaMemcpyBatchAsync of CUDA 13 (the runtime's own declaration, with its attribute structs as laid out there:
// int enums, a {type, id} location each): one call for a whole batch of copies, which the driver may run in
// any order within the batch, after the stream's earlier work.
struct MemLocation {
  int type;  // cudaMemLocationType: 0, no hint (ignored for memory that is not managed)
  int id;
};
struct MemcpyAttributes {
  int src_access_order;  // cudaMemcpySrcAccessOrder: 1, the sources are read in stream order
  MemLocation src_hint;
  MemLocation dst_hint;
  unsigned int flags;  // cudaMemcpyFlags: 1, prefer overlap with compute
};
using MemcpyBatchAsync = int (*)(const void* const* dsts, const void* const* srcs, const size_t* sizes, size_t count,
                                 MemcpyAttributes* attrs, size_t* attrs_idxs, size_t num_attrs, void* stream);

// ``memcpy_async`` in one call of cudaMemcpyBatchAsync(fn): the same (tensor index, offset, bytes) triples, the
// sources read in stream order. Returns the runtime's error code (0: every copy is queued; else none may be
// counted on, and the caller queues them again one by one).
int memcpy_batch_async(int64_t fn, int64_t stream, int64_t base, const py::bytes& ptrs, const py::bytes& copies,
                       int64_t kind) {
  const auto [src, cp, count] = plan_copies(ptrs, copies, "memcpy_batch_async");
  if (fn == 0) throw std::invalid_argument("memcpy_batch_async: no cudaMemcpyBatchAsync");
  if (count == 0) return 0;
  std::vector<const void*> dsts(count), srcs(count);
  std::vector<size_t> sizes(count);
  auto* host = reinterpret_cast<char*>(base);
  for (size_t k = 0; k < count; ++k) {
    const void* dev = reinterpret_cast<const void*>(src[cp[3 * k]]);
    const void* h = host + cp[3 * k + 1];
    dsts[k] = kind == 2 ? h : dev;
    srcs[k] = kind == 2 ? dev : h;
    sizes[k] = static_cast<size_t>(cp[3 * k + 2]);
  }
  MemcpyAttributes attr{1, {0, 0}, {0, 0}, 1};
  size_t first = 0;
  auto batch = reinterpret_cast<MemcpyBatchAsync>(fn);
  py::gil_scoped_release release;
  return batch(dsts.data(), srcs.data(), sizes.data(), count, &attr, &first, 1, reinterpret_cast<void*>(stream));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("memcpy_batch_async", &memcpy_batch_async, "queues a plan's copies in one cudaMemcpyBatchAsync (CUDA 13)");
  m.def("memcpy_async", &memcpy_async, "queues a plan's copies with cudaMemcpyAsync on a stream (GIL released)");
  m.def("flatten_like", &flatten_like, "the tensors of a tree shaped exactly like a cached skeleton, or None");
  m.def("scan", &scan, "signature, storage pointers and first unstorable index of a tensor list");
  m.def("copy_storages", &copy_storages, "copies a plan's storages into a slot (GIL released)");
}
