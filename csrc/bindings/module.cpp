// flashattn_mps._C: the thin pybind11 layer. Plain integers and tuples in, C structs out; C status
// codes become Python exceptions. No torch headers: the Python layer hands over storage pointers.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <string>
#include <vector>

extern "C" {
#include "../cpu_device/cpu_device.h"
#include "../fa_plan.h"
#if defined(__APPLE__)
#include "../metal_backend/metal_backend.h"
#endif
}

namespace py = pybind11;

namespace {

// Exception types live as long as the module (deliberately never released: interpreter teardown
// order makes releasing them unsafe).
PyObject *compile_error_type = nullptr;
PyObject *dispatch_error_type = nullptr;

[[noreturn]] void raise_status(const fa_status &st) {
    if (PyErr_CheckSignals() != 0) { // Ctrl-C stopped the call: KeyboardInterrupt, not its error
        throw py::error_already_set();
    }
    switch (st.code) {
    case FA_ERR_VALUE:
        throw py::value_error(st.message);
    case FA_ERR_TYPE:
        throw py::type_error(st.message);
    case FA_ERR_COMPILE:
        PyErr_SetString(compile_error_type, st.message);
        throw py::error_already_set();
    default:
        PyErr_SetString(dispatch_error_type, st.message);
        throw py::error_already_set();
    }
}

void check(int32_t rc, const fa_status &st) {
    if (rc != FA_OK) {
        raise_status(st);
    }
}

// A tensor descriptor as the Python layer builds it:
// (storage, storage_bytes, byte_offset, dtype, sizes, strides).
fa_tensor to_tensor(const py::handle &obj, const char *name) {
    fa_tensor t;
    std::memset(&t, 0, sizeof t);
    if (obj.is_none()) {
        return t;
    }
    auto fields = py::cast<py::tuple>(obj);
    if (fields.size() != 6) {
        throw py::value_error(std::string(name) + ": a descriptor has 6 fields, got " + std::to_string(fields.size()));
    }
    t.storage = reinterpret_cast<void *>(py::cast<uintptr_t>(fields[0]));
    t.storage_bytes = py::cast<int64_t>(fields[1]);
    t.byte_offset = py::cast<int64_t>(fields[2]);
    t.dtype = py::cast<int32_t>(fields[3]);
    auto sizes = py::cast<std::vector<int64_t>>(fields[4]);
    auto strides = py::cast<std::vector<int64_t>>(fields[5]);
    if (sizes.size() != strides.size() || sizes.size() > FA_MAX_DIMS) {
        throw py::value_error(std::string(name) + ": sizes and strides must have the same length, at most 4");
    }
    t.ndim = static_cast<int32_t>(sizes.size());
    for (size_t d = 0; d < sizes.size(); ++d) {
        t.sizes[d] = sizes[d];
        t.strides[d] = strides[d];
    }
    return t;
}

fa_forward_args forward_args(int32_t device, py::handle q, py::handle k, py::handle v, py::handle out,
                             py::handle lse, double scale, bool causal, int32_t kernel, py::handle mask) {
    fa_forward_args args;
    std::memset(&args, 0, sizeof args);
    args.device = device;
    args.q = to_tensor(q, "q");
    args.k = to_tensor(k, "k");
    args.v = to_tensor(v, "v");
    args.out = to_tensor(out, "out");
    args.lse = to_tensor(lse, "lse");
    args.mask = to_tensor(mask, "mask");
    args.scale = scale;
    args.causal = causal;
    args.kernel = kernel;
    return args;
}

void forward(int32_t device, py::handle q, py::handle k, py::handle v, py::handle out, py::handle lse,
             double scale, bool causal, int32_t kernel, py::handle workspace, py::handle mask) {
    fa_forward_args args = forward_args(device, q, k, v, out, lse, scale, causal, kernel, mask);
    args.workspace = to_tensor(workspace, "workspace");
    fa_status st;
    int32_t rc;
    {
        py::gil_scoped_release release;
        rc = fa_forward(&args, &st);
    }
    check(rc, st);
}

int64_t forward_workspace_bytes(int32_t device, py::handle q, py::handle k, py::handle v, py::handle out,
                                py::handle lse, double scale, bool causal, int32_t kernel, py::handle mask) {
    const fa_forward_args args = forward_args(device, q, k, v, out, lse, scale, causal, kernel, mask);
    fa_status st;
    const int64_t bytes = fa_forward_workspace_bytes(&args, &st);
    if (bytes < 0) {
        raise_status(st);
    }
    return bytes;
}

// The planner's decision, for tests and curiosity: kernels with their grids, the split count and
// the workspace size.
py::dict plan_forward(int32_t device, py::handle q, py::handle k, py::handle v, py::handle out, py::handle lse,
                      double scale, bool causal, int32_t kernel, py::handle mask) {
    const fa_forward_args args = forward_args(device, q, k, v, out, lse, scale, causal, kernel, mask);
    fa_plan plan;
    fa_status st;
    check(fa_plan_forward(&args, &plan, &st), st);
    py::list dispatches;
    for (uint32_t i = 0; i < plan.n_dispatches; ++i) {
        const fa_plan_dispatch &d = plan.dispatches[i];
        py::dict macros;
        for (uint32_t m = 0; m < d.n_macros; ++m) {
            macros[d.macros[m].name] = d.macros[m].value;
        }
        dispatches.append(py::dict(py::arg("function") = d.function, py::arg("macros") = macros,
                                   py::arg("grid") = py::make_tuple(d.grid[0], d.grid[1], d.grid[2]),
                                   py::arg("threadgroup") =
                                       py::make_tuple(d.threadgroup[0], d.threadgroup[1], d.threadgroup[2])));
    }
    return py::dict(py::arg("dispatches") = dispatches, py::arg("empty") = plan.empty != 0,
                    py::arg("split_count") = plan.params.split_count,
                    py::arg("workspace_bytes") = plan.workspace_bytes);
}

void backward(int32_t device, py::handle q, py::handle k, py::handle v, py::handle out, py::handle lse,
              py::handle dout, py::handle delta, py::handle dq, py::handle dk, py::handle dv, double scale,
              bool causal, py::handle mask) {
    fa_backward_args args;
    std::memset(&args, 0, sizeof args);
    args.device = device;
    args.q = to_tensor(q, "q");
    args.k = to_tensor(k, "k");
    args.v = to_tensor(v, "v");
    args.out = to_tensor(out, "out");
    args.lse = to_tensor(lse, "lse");
    args.dout = to_tensor(dout, "dout");
    args.delta = to_tensor(delta, "delta");
    args.dq = to_tensor(dq, "dq");
    args.dk = to_tensor(dk, "dk");
    args.dv = to_tensor(dv, "dv");
    args.mask = to_tensor(mask, "mask");
    args.scale = scale;
    args.causal = causal;
    fa_status st;
    int32_t rc;
    {
        py::gil_scoped_release release;
        rc = fa_backward(&args, &st);
    }
    check(rc, st);
}

void register_source(const std::string &name, const std::string &text) {
    fa_status st;
    check(fa_register_source(name.c_str(), text.c_str(), &st), st);
}

// A compiled CPU-device library; the C side keeps it for the life of the process.
struct Library {
    const mcpu_library *lib;
};

Library compile_library(const std::string &source, const std::string &name,
                        const std::vector<std::pair<std::string, std::string>> &macros) {
    std::vector<mcpu_macro> c_macros;
    for (const auto &m : macros) {
        c_macros.push_back({m.first.c_str(), m.second.c_str()});
    }
    mcpu_library *lib = nullptr;
    fa_status st;
    int32_t rc;
    {
        py::gil_scoped_release release;
        rc = mcpu_compile_library(source.c_str(), name.c_str(), c_macros.data(),
                                  static_cast<uint32_t>(c_macros.size()), &lib, &st);
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

// buffers: host addresses (storage offset applied) or bytes objects (setBytes); the Python layer
// (flashattn_mps.metal_cpu) validates tensors before their addresses get here.
void library_dispatch(const Library &l, const std::string &kernel, std::array<uint32_t, 3> grid,
                      std::array<uint32_t, 3> threadgroup, const py::list &buffers,
                      const std::vector<uint64_t> &threadgroup_lengths,
                      const std::vector<std::tuple<uint32_t, int32_t, int64_t, double>> &constants) {
    std::vector<void *> addresses;
    std::vector<std::string> byte_copies; // keeps setBytes data alive without the GIL
    byte_copies.reserve(buffers.size());
    for (const auto &b : buffers) {
        if (py::isinstance<py::bytes>(b)) {
            byte_copies.push_back(py::cast<std::string>(b));
            addresses.push_back(byte_copies.back().data());
        } else {
            addresses.push_back(reinterpret_cast<void *>(py::cast<uintptr_t>(b)));
        }
    }
    std::vector<msl_constant_value> values;
    for (const auto &c : constants) {
        const uint32_t index = std::get<0>(c);
        if (index >= MSL_MAX_FUNCTION_CONSTANTS) {
            throw py::value_error("constants: index " + std::to_string(index) + " is out of range 0.." +
                                  std::to_string(MSL_MAX_FUNCTION_CONSTANTS - 1));
        }
        if (values.size() <= index) {
            values.resize(index + 1, msl_constant_value{MSL_CONSTANT_UNDEFINED, 0, 0.0});
        }
        values[index] = msl_constant_value{std::get<1>(c), std::get<2>(c), std::get<3>(c)};
    }
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
    fa_status st;
    int32_t rc;
    {
        py::gil_scoped_release release;
        rc = mcpu_dispatch(l.lib, &args, &st);
    }
    check(rc, st);
}

std::string preprocess(const std::string &source, const std::string &name, bool strict) {
    fa_status st;
    char *text = mcpu_preprocess(source.c_str(), name.c_str(), strict ? 1 : 0, &st);
    if (text == nullptr) {
        raise_status(st);
    }
    std::string result(text);
    free(text);
    return result;
}

py::list specialisations() {
    py::list out;
    fa_plan_each_specialisation(
        [](const fa_pipeline_key *key, void *ctx) -> int32_t {
            py::list macros;
            for (uint32_t i = 0; i < key->n_macros; ++i) {
                macros.append(py::make_tuple(key->macros[i].name, key->macros[i].value));
            }
            static_cast<py::list *>(ctx)->append(py::make_tuple(key->source_name, key->function, macros));
            return 0;
        },
        &out);
    return out;
}

std::string cache_dir() {
    char path[4096];
    fa_status st;
    check(mcpu_cache_dir(path, sizeof path, &st), st);
    return path;
}

std::string shim_dir() {
    char path[4096];
    fa_status st;
    check(mcpu_shim_dir(path, sizeof path, &st), st);
    return path;
}

} // namespace

PYBIND11_MODULE(_C, m) {
    m.doc() = "flashattn-mps C core (internal; use flashattn_mps)";
    compile_error_type = PyErr_NewException("flashattn_mps.MetalCompileError", PyExc_RuntimeError, nullptr);
    dispatch_error_type = PyErr_NewException("flashattn_mps.MetalDispatchError", PyExc_RuntimeError, nullptr);
    m.attr("MetalCompileError") = py::handle(compile_error_type);
    m.attr("MetalDispatchError") = py::handle(dispatch_error_type);

    m.attr("DTYPE_FLOAT32") = static_cast<int>(FA_F32);
    m.attr("DTYPE_FLOAT16") = static_cast<int>(FA_F16);
    m.attr("DTYPE_BFLOAT16") = static_cast<int>(FA_BF16);
    m.attr("DTYPE_BOOL") = static_cast<int>(FA_BOOL);
    m.attr("DEVICE_CPU") = static_cast<int>(FA_DEVICE_CPU);
    m.attr("DEVICE_MPS") = static_cast<int>(FA_DEVICE_MPS);
    m.attr("KERNEL_AUTO") = static_cast<int>(FA_KERNEL_AUTO);
    m.attr("KERNEL_SIMPLE") = static_cast<int>(FA_KERNEL_SIMPLE);
    m.attr("KERNEL_FORWARD") = static_cast<int>(FA_KERNEL_FORWARD);
    m.attr("KERNEL_DECODE") = static_cast<int>(FA_KERNEL_DECODE);
    m.attr("CONSTANT_BOOL") = static_cast<int>(MSL_CONSTANT_BOOL);
    m.attr("CONSTANT_INT") = static_cast<int>(MSL_CONSTANT_INT);
    m.attr("CONSTANT_FLOAT") = static_cast<int>(MSL_CONSTANT_FLOAT);
    m.attr("MAX_THREADGROUP_MEMORY") = static_cast<int>(MCPU_MAX_THREADGROUP_MEMORY);
#if defined(__APPLE__)
    m.attr("HAS_METAL_BACKEND") = true;
#else
    m.attr("HAS_METAL_BACKEND") = false;
#endif

    m.def("forward", &forward, "Validate, plan and run attention (descriptors as tuples)", py::arg("device"),
          py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"), py::arg("lse"), py::arg("scale"),
          py::arg("causal"), py::arg("kernel"), py::arg("workspace") = py::none(), py::arg("mask") = py::none());
    m.def("forward_workspace_bytes", &forward_workspace_bytes,
          "Bytes of workspace forward needs for these descriptors (same arguments, no workspace)", py::arg("device"),
          py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"), py::arg("lse"), py::arg("scale"),
          py::arg("causal"), py::arg("kernel"), py::arg("mask") = py::none());
    m.def("plan_forward", &plan_forward, "The plan forward would run: dispatches, split count, workspace bytes",
          py::arg("device"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"), py::arg("lse"),
          py::arg("scale"), py::arg("causal"), py::arg("kernel"), py::arg("mask") = py::none());
    m.def("backward", &backward,
          "Gradients of forward: dq, dk, dv from q, k, v, out, lse and dout (descriptors as tuples); delta is "
          "(B, Hq, L) float32 scratch",
          py::arg("device"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"), py::arg("lse"),
          py::arg("dout"), py::arg("delta"), py::arg("dq"), py::arg("dk"), py::arg("dv"), py::arg("scale"),
          py::arg("causal"), py::arg("mask") = py::none());
    m.def("register_source", &register_source, py::arg("name"), py::arg("text"));
    m.def("specialisations", &specialisations);
    m.def("preprocess", &preprocess, py::arg("source"), py::arg("name"), py::arg("strict"));
    m.def("cache_dir", &cache_dir);
    m.def("shim_dir", &shim_dir);

#if defined(__APPLE__)
    m.def("metal_set_stream_mode", &fa_metal_set_stream_mode, py::arg("use_torch_stream"),
          "1: encode on PyTorch's MPS stream (torch >= 2.9); 0: own queue, commit and wait. "
          "Returns the mode in effect.");
#endif

    py::class_<Library>(m, "CpuLibrary")
        .def("kernels", &library_kernels)
        .def("dispatch", &library_dispatch, py::arg("kernel"), py::arg("grid"), py::arg("threadgroup"),
             py::arg("buffers"), py::arg("threadgroup_lengths"), py::arg("constants"));
    m.def("compile_library", &compile_library, py::arg("source"), py::arg("name"), py::arg("macros"));
    m.def("set_cpu_watchdog", [](double seconds) {
        fa_status st;
        check(mcpu_set_watchdog(seconds, &st), st);
    });
    m.def("cpu_watchdog", &mcpu_watchdog);
}
