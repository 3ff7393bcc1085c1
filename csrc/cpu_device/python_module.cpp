// flashattn_mps._metal_cpu: the CPU Metal device's Python API (flashattn_mps.metal_cpu wraps it)
// and, as the capsule _api, the table other extension modules call the device through
// (metal_cpu.h, mcpu_api). Status codes become Python exceptions: MetalCompileError,
// MetalDispatchError (which flashattn_mps._C raises too), ValueError.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

extern "C" {
#include "metal_cpu.h"
#include "shim_files.h"
}

namespace py = pybind11;

namespace {

// Exception types live as long as the module (deliberately never released: interpreter teardown
// order makes releasing them unsafe).
PyObject *compile_error_type = nullptr;
PyObject *dispatch_error_type = nullptr;

[[noreturn]] void raise_status(const mcpu_status &st) {
    if (PyErr_CheckSignals() != 0) { // Ctrl-C stopped the call: KeyboardInterrupt, not its error
        throw py::error_already_set();
    }
    switch (st.code) {
    case MCPU_ERR_VALUE: throw py::value_error(st.message);
    case MCPU_ERR_COMPILE: PyErr_SetString(compile_error_type, st.message); throw py::error_already_set();
    default: PyErr_SetString(dispatch_error_type, st.message); throw py::error_already_set();
    }
}

void check(int32_t rc, const mcpu_status &st) {
    if (rc != MCPU_OK) {
        raise_status(st);
    }
}

// A compiled library; the C side keeps it for the life of the process.
struct Library {
    const mcpu_library *lib;
};

// checked: 1 or 0, or -1 for the default (mcpu_checked: $FLASHATTN_MPS_CPU_CHECKED, set_checked)
Library compile_library(const std::string &source, const std::string &name,
                        const std::vector<std::pair<std::string, std::string>> &macros, int32_t checked,
                        bool lockstep) {
    std::vector<mcpu_macro> c_macros;
    for (const auto &m : macros) {
        c_macros.push_back({m.first.c_str(), m.second.c_str()});
    }
    mcpu_library *lib = nullptr;
    mcpu_status st;
    int32_t rc;
    {
        py::gil_scoped_release release;
        if (checked < 0) {
            checked = mcpu_checked(&st);
        }
        rc = checked < 0
                 ? st.code
                 : mcpu_compile_library(source.c_str(), name.c_str(), c_macros.data(),
                                        static_cast<uint32_t>(c_macros.size()),
                                        (checked ? MCPU_CHECKED : 0u) | (lockstep ? MCPU_LOCKSTEP : 0u), &lib, &st);
    }
    check(rc, st);
    return Library{lib};
}

std::vector<std::string> library_kernels(const Library &l) {
    std::vector<std::string> names;
    for (const char *const *n = mcpu_library_kernels(l.lib); n != nullptr && *n != nullptr; ++n) {
        names.emplace_back(*n);
    }
    return names;
}

// A host address: an int in 0..2^64-1.
void *host_address(PyObject *o, const std::string &name) {
    if (!PyLong_Check(o)) {
        throw py::type_error(name + " must be bytes or an int (a host address), got " +
                             std::string(Py_TYPE(o)->tp_name));
    }
    const unsigned long long value = PyLong_AsUnsignedLongLong(o);
    if (value == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
        PyErr_Clear();
        throw py::value_error(name + " must be an int in 0..2^64-1, got " + std::string(py::str(o)));
    }
    return reinterpret_cast<void *>(static_cast<uintptr_t>(value));
}

// buffers: host addresses (storage offset applied) or bytes objects (setBytes); the Python layer
// (flashattn_mps.metal_cpu) validates tensors before their addresses get here.
void library_dispatch(const Library &l, const std::string &kernel, std::array<uint32_t, 3> grid,
                      std::array<uint32_t, 3> threadgroup, const py::list &buffers,
                      const std::vector<uint64_t> &threadgroup_lengths,
                      const std::vector<std::tuple<uint32_t, int32_t, int64_t, double>> &constants,
                      std::vector<uint64_t> buffer_lengths) {
    std::vector<void *> addresses;
    std::vector<std::string> byte_copies; // keeps setBytes data alive without the GIL
    byte_copies.reserve(buffers.size());
    // lengths of the buffers (bytes objects: their own), UINT64_MAX where unknown, for checked mode
    buffer_lengths.resize(buffers.size(), UINT64_MAX);
    for (const auto &b : buffers) {
        if (py::isinstance<py::bytes>(b)) {
            byte_copies.push_back(py::cast<std::string>(b));
            buffer_lengths[addresses.size()] = byte_copies.back().size();
            addresses.push_back(byte_copies.back().data());
        } else {
            addresses.push_back(host_address(b.ptr(), "buffers[" + std::to_string(addresses.size()) + "]"));
        }
    }
    std::vector<msl_constant_value> values; // by increasing index, as mcpu_dispatch takes them
    for (const auto &c : constants) {
        const uint32_t index = std::get<0>(c);
        if (index >= MSL_FUNCTION_CONSTANT_INDICES) {
            throw py::value_error("constants: index " + std::to_string(index) + " is out of range 0.." +
                                  std::to_string(MSL_FUNCTION_CONSTANT_INDICES - 1));
        }
        values.push_back(msl_constant_value{std::get<1>(c), index, std::get<2>(c), std::get<3>(c)});
    }
    std::sort(values.begin(), values.end(),
              [](const msl_constant_value &a, const msl_constant_value &b) { return a.index < b.index; });
    mcpu_dispatch_args args;
    std::memset(&args, 0, sizeof args);
    args.kernel = kernel.c_str();
    std::memcpy(args.grid, grid.data(), sizeof args.grid);
    std::memcpy(args.threadgroup, threadgroup.data(), sizeof args.threadgroup);
    args.buffers = addresses.data();
    args.n_buffers = static_cast<uint32_t>(addresses.size());
    args.threadgroup_arg_lengths = threadgroup_lengths.data();
    args.n_threadgroup_args = static_cast<uint32_t>(threadgroup_lengths.size());
    args.constants = values.data();
    args.n_constants = static_cast<uint32_t>(values.size());
    args.buffer_lengths = buffer_lengths.data();
    mcpu_status st;
    int32_t rc;
    {
        py::gil_scoped_release release;
        rc = mcpu_dispatch(l.lib, &args, &st);
    }
    check(rc, st);
}

std::string preprocess(const std::string &source, const std::string &name, bool strict) {
    mcpu_status st;
    char *text = mcpu_preprocess(source.c_str(), name.c_str(), strict ? 1 : 0, &st);
    if (text == nullptr) {
        raise_status(st);
    }
    std::string result(text);
    free(text);
    return result;
}

std::string directory(int32_t (*get)(char *, size_t, mcpu_status *)) {
    char path[4096];
    mcpu_status st;
    check(get(path, sizeof path, &st), st);
    return path;
}

} // namespace

PYBIND11_MODULE(_metal_cpu, m) {
    m.doc() = "The CPU Metal device (internal; use flashattn_mps.metal_cpu)";
    compile_error_type = PyErr_NewException("flashattn_mps.MetalCompileError", PyExc_RuntimeError, nullptr);
    dispatch_error_type = PyErr_NewException("flashattn_mps.MetalDispatchError", PyExc_RuntimeError, nullptr);
    m.attr("MetalCompileError") = py::handle(compile_error_type);
    m.attr("MetalDispatchError") = py::handle(dispatch_error_type);
    m.attr("MAX_THREADGROUP_MEMORY") = static_cast<int>(MCPU_MAX_THREADGROUP_MEMORY);
    m.attr("CONSTANT_BOOL") = static_cast<int>(MSL_CONSTANT_BOOL);
    m.attr("CONSTANT_INT") = static_cast<int>(MSL_CONSTANT_INT);
    m.attr("CONSTANT_FLOAT") = static_cast<int>(MSL_CONSTANT_FLOAT);
    py::tuple compilers(mcpu_compiler_name_count);
    for (uint32_t i = 0; i < mcpu_compiler_name_count; ++i) {
        compilers[i] = py::str(mcpu_compiler_names[i]);
    }
    m.attr("COMPILERS") = compilers; // compilers.txt: what the device (and the strict check) look for
    // const: the capsule hands out a table no caller may change.
    m.attr("_api") = py::reinterpret_steal<py::object>(
        PyCapsule_New(const_cast<mcpu_api *>(mcpu_api_table()), MCPU_API_CAPSULE, nullptr));

    py::class_<Library>(m, "Library")
        .def("kernels", &library_kernels)
        .def("dispatch", &library_dispatch, py::arg("kernel"), py::arg("grid"), py::arg("threadgroup"),
             py::arg("buffers"), py::arg("threadgroup_lengths"), py::arg("constants"),
             py::arg("buffer_lengths") = std::vector<uint64_t>());
    m.def("compile_library", &compile_library, py::arg("source"), py::arg("name"), py::arg("macros"),
          py::arg("checked") = -1, py::arg("lockstep") = false);
    m.def("preprocess", &preprocess, py::arg("source"), py::arg("name"), py::arg("strict"));
    m.def("cache_dir", []() { return directory(mcpu_cache_dir); });
    m.def("shim_dir", []() { return directory(mcpu_shim_dir); });
    m.def("preprocessor_flags", []() {
        const char *const *flags = nullptr;
        const uint32_t n = mcpu_preprocessor_flags(&flags);
        return std::vector<std::string>(flags, flags + n);
    });
    m.def("set_checked", [](int32_t checked) { mcpu_set_checked(checked); }); // 1, 0, -1: the environment's
    m.def("checked_dispatches", &mcpu_checked_dispatches);
    m.def("checked", []() {
        mcpu_status st;
        const int32_t checked = mcpu_checked(&st);
        if (checked < 0) raise_status(st);
        return checked != 0;
    });
    m.def("set_watchdog", [](double seconds) {
        mcpu_status st;
        check(mcpu_set_watchdog(seconds, &st), st);
    });
    m.def("watchdog", &mcpu_watchdog);
}
