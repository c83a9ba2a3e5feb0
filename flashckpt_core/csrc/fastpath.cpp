// flashckpt's per-tensor hot path in C++: the structure of a tensor list (a snapshot's signature) and
// the copies of many small storages, without a Python call per tensor.
//
// Built on first use by flashckpt_core._native (torch.utils.cpp_extension); flashckpt runs the same
// logic in Python wherever this cannot be built.
#include <torch/extension.h>

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

}  // namespace

// For each tensor: dtype, device index (-1: CPU), requires_grad, is-Parameter, storage offset, storage
// bytes, storage sharing group (-1: empty storage), ndim, sizes, strides; packed as int64s. Returns
// (signature bytes, storage data pointers as int64 bytes, index of the first tensor flashckpt cannot
// store or -1). Two lists with equal signatures lay out alike in a snapshot.
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
    put(sig, t.requires_grad() ? 1 : 0);
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

// Copies the storages of a plan: for every (tensor index, destination offset, bytes) triple in
// ``copies`` (int64s), ``bytes`` from ``ptrs[index]`` to ``dst_base + offset``. The GIL is released.
void copy_storages(int64_t dst_base, const py::bytes& ptrs, const py::bytes& copies) {
  std::string_view p = ptrs;
  std::string_view c = copies;
  const auto* src = reinterpret_cast<const int64_t*>(p.data());
  const auto* cp = reinterpret_cast<const int64_t*>(c.data());
  const size_t count = c.size() / (3 * sizeof(int64_t));
  const size_t nsrc = p.size() / sizeof(int64_t);
  for (size_t k = 0; k < count; ++k) {
    if (static_cast<size_t>(cp[3 * k]) >= nsrc) throw std::out_of_range("copy_storages: tensor index out of range");
  }
  py::gil_scoped_release release;
  auto* dst = reinterpret_cast<char*>(dst_base);
  for (size_t k = 0; k < count; ++k) {
    std::memcpy(dst + cp[3 * k + 1], reinterpret_cast<const char*>(src[cp[3 * k]]), static_cast<size_t>(cp[3 * k + 2]));
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("scan", &scan, "signature, storage pointers and first unstorable index of a tensor list");
  m.def("copy_storages", &copy_storages, "copies a plan's storages into a slot (GIL released)");
}
