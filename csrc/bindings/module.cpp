// flashattn_mps._C: the thin pybind11 layer. Plain integers and tuples in, C structs out; C status
// codes become Python exceptions. No torch headers: the Python layer hands over storage pointers.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

extern "C" {
#include "../cpu_device/metal_cpu.h" // MCPU_API_CAPSULE only: the device is reached through its table
#include "../fa_backend.h"
#include "../fa_cache.h"
#include "../fa_plan_cache.h"
}

namespace py = pybind11;

void add_metal_bindings(py::module_ &m, void (*raise_status)(const fa_status &)); // metal_bindings.cpp

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
    case FA_ERR_VALUE: throw py::value_error(st.message);
    case FA_ERR_TYPE: throw py::type_error(st.message);
    case FA_ERR_COMPILE: PyErr_SetString(compile_error_type, st.message); throw py::error_already_set();
    default: PyErr_SetString(dispatch_error_type, st.message); throw py::error_already_set();
    }
}

void check(int32_t rc, const fa_status &st) {
    if (rc != FA_OK) {
        raise_status(st);
    }
}

// The Python type of o, for messages ("str", "numpy.bool", "torch.Tensor").
std::string type_name(PyObject *o) {
    py::handle type(reinterpret_cast<PyObject *>(Py_TYPE(o)));
    const std::string module = py::str(type.attr("__module__"));
    const std::string name = py::str(type.attr("__qualname__"));
    return module == "builtins" ? name : module + "." + name;
}

std::string what_of(const char *tensor, const char *field) { return std::string(tensor) + ": " + field; }

int64_t as_int64(PyObject *o, const char *tensor, const char *field) {
    if (!PyLong_Check(o)) {
        throw py::type_error(what_of(tensor, field) + " must be an int, got " + type_name(o));
    }
    int overflow = 0;
    const long long value = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (overflow != 0) {
        throw py::value_error(what_of(tensor, field) + " must fit in 64 bits, got " + std::string(py::str(o)));
    }
    return value;
}

void *as_address(PyObject *o, const char *tensor, const char *field) {
    if (!PyLong_Check(o)) {
        throw py::type_error(what_of(tensor, field) + " must be an int (an address or id<MTLBuffer>), got " +
                             type_name(o));
    }
    const unsigned long long value = PyLong_AsUnsignedLongLong(o);
    if (value == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
        PyErr_Clear();
        throw py::value_error(what_of(tensor, field) + " must be an int in 0..2^64-1, got " + std::string(py::str(o)));
    }
    return reinterpret_cast<void *>(static_cast<uintptr_t>(value));
}

// sizes or strides: a sequence of ints (tuple, list, torch.Size), its length in *n.
void read_dims(PyObject *o, const char *tensor, const char *field, int64_t *out, int32_t *n) {
    py::object fast = py::reinterpret_steal<py::object>(PySequence_Fast(o, ""));
    if (!fast) {
        PyErr_Clear();
        throw py::type_error(what_of(tensor, field) + " must be a sequence of ints, got " + type_name(o));
    }
    const Py_ssize_t len = PySequence_Fast_GET_SIZE(fast.ptr());
    if (len > FA_MAX_DIMS) {
        throw py::value_error(what_of(tensor, field) + ": " + std::to_string(len) +
                              " dims; sizes and strides must have the same length, at most 4");
    }
    PyObject **items = PySequence_Fast_ITEMS(fast.ptr());
    for (Py_ssize_t d = 0; d < len; ++d) {
        out[d] = as_int64(items[d], tensor, field);
    }
    *n = static_cast<int32_t>(len);
}

// A descriptor as flashattn_mps._api.describe builds it:
// (storage, storage_bytes, byte_offset, dtype, sizes, strides).
fa_tensor from_descriptor(PyObject *obj, const char *name) {
    fa_tensor t;
    std::memset(&t, 0, sizeof t);
    py::object fast = py::reinterpret_steal<py::object>(PySequence_Fast(obj, ""));
    const Py_ssize_t n = fast ? PySequence_Fast_GET_SIZE(fast.ptr()) : -1;
    if (n != 6) {
        throw py::value_error(std::string(name) +
                              ": a descriptor has 6 fields (storage, storage_bytes, byte_offset, "
                              "dtype, sizes, strides), got " +
                              std::to_string(n));
    }
    PyObject **f = PySequence_Fast_ITEMS(fast.ptr());
    t.storage = as_address(f[0], name, "storage");
    t.storage_bytes = as_int64(f[1], name, "storage_bytes");
    t.byte_offset = as_int64(f[2], name, "byte_offset");
    const int64_t dtype = as_int64(f[3], name, "dtype");
    t.dtype = dtype >= INT32_MIN && dtype <= INT32_MAX ? static_cast<int32_t>(dtype) : INT32_MAX; // core rejects
    int32_t n_strides = 0;
    read_dims(f[4], name, "sizes", t.sizes, &t.ndim);
    read_dims(f[5], name, "strides", t.strides, &n_strides);
    if (n_strides != t.ndim) {
        throw py::value_error(std::string(name) + ": " + std::to_string(t.ndim) + " sizes and " +
                              std::to_string(n_strides) +
                              " strides; sizes and strides must have the same length, "
                              "at most 4");
    }
    return t;
}

// What a torch.Tensor argument is read through (interned names), and its dtype codes
// ({torch.float32: FA_F32, ...}, handed over once by flashattn_mps._api).
struct TensorReader {
    PyObject *untyped_storage, *data_ptr, *nbytes, *storage_offset, *dtype, *shape, *stride, *is_cpu, *is_mps;
    PyObject *dtype_codes = nullptr;
} tensor_reader; // lives as long as the module, like the exception types

py::object call_method(PyObject *o, PyObject *method) {
    PyObject *r = PyObject_CallMethodNoArgs(o, method);
    if (!r) {
        throw py::error_already_set();
    }
    return py::reinterpret_steal<py::object>(r);
}

// A torch.Tensor's descriptor, read from the tensor itself, which must be on the call's device (a
// host address read as an id<MTLBuffer>, or the reverse, would crash). batch_dim: prepend a batch
// dim of 1 (the unbatched 3-D call; its stride is never used).
fa_tensor from_torch(PyObject *obj, const char *name, int32_t device, bool batch_dim) {
    const TensorReader &r = tensor_reader;
    fa_tensor t;
    std::memset(&t, 0, sizeof t);
    PyObject *dtype = PyObject_GetAttr(obj, r.dtype);
    if (!dtype) {
        PyErr_Clear();
        throw py::type_error(std::string(name) + " must be a torch.Tensor, a 6-field descriptor or None, got " +
                             type_name(obj));
    }
    py::object dtype_ref = py::reinterpret_steal<py::object>(dtype);
    PyObject *code = r.dtype_codes ? PyDict_GetItemWithError(r.dtype_codes, dtype) : nullptr;
    if (!code) {
        PyErr_Clear(); // an unhashable dtype attribute is just not a tensor's
        throw py::type_error(std::string(name) + ": got a " + type_name(obj) + " of dtype " +
                             std::string(py::str(dtype)) +
                             "; expected a torch.Tensor of dtype float32, float16 "
                             "or bfloat16 (bool for masks), a 6-field descriptor or None");
    }
    t.dtype = static_cast<int32_t>(PyLong_AsLong(code));
    py::object on_device =
        py::reinterpret_steal<py::object>(PyObject_GetAttr(obj, device == FA_DEVICE_MPS ? r.is_mps : r.is_cpu));
    if (!on_device) {
        throw py::error_already_set();
    }
    if (on_device.ptr() != Py_True) {
        throw py::value_error(std::string(name) + " is on device " +
                              std::string(py::str(py::handle(obj).attr("device"))) + "; this call runs on " +
                              (device == FA_DEVICE_MPS ? "mps" : "cpu") + " (device code " + std::to_string(device) +
                              ")");
    }
    py::object storage = call_method(obj, r.untyped_storage);
    t.storage = as_address(call_method(storage.ptr(), r.data_ptr).ptr(), name, "storage");
    t.storage_bytes = as_int64(call_method(storage.ptr(), r.nbytes).ptr(), name, "storage_bytes");
    t.byte_offset =
        as_int64(call_method(obj, r.storage_offset).ptr(), name, "storage_offset") * fa_dtype_bytes(t.dtype);
    const int32_t first = batch_dim ? 1 : 0;
    int32_t n_sizes = 0, n_strides = 0;
    py::object shape = py::reinterpret_steal<py::object>(PyObject_GetAttr(obj, r.shape));
    if (!shape) {
        throw py::error_already_set();
    }
    if (!PyTuple_Check(shape.ptr())) {
        throw py::type_error(std::string(name) + ": shape of a " + type_name(obj) + " is not a tuple");
    }
    if (PyTuple_GET_SIZE(shape.ptr()) + first > FA_MAX_DIMS) {
        throw py::value_error(std::string(name) + ": " + std::to_string(PyTuple_GET_SIZE(shape.ptr())) +
                              "-D tensor; at most " + std::to_string(FA_MAX_DIMS - first) + " dims here");
    }
    read_dims(shape.ptr(), name, "sizes", t.sizes + first, &n_sizes);
    read_dims(call_method(obj, r.stride).ptr(), name, "strides", t.strides + first, &n_strides);
    if (batch_dim) {
        t.sizes[0] = 1;
        t.strides[0] = 0;
    }
    t.ndim = n_sizes + first;
    return t;
}

// A tensor argument: None (absent), a descriptor tuple or list, or a torch.Tensor. batch_dim
// applies to tensors only: descriptors are taken as they are.
fa_tensor to_tensor(const py::handle &obj, const char *name, int32_t device, bool batch_dim = false) {
    if (obj.is_none()) {
        fa_tensor t;
        std::memset(&t, 0, sizeof t);
        return t;
    }
    if (PyTuple_Check(obj.ptr()) || PyList_Check(obj.ptr())) {
        return from_descriptor(obj.ptr(), name);
    }
    return from_torch(obj.ptr(), name, device, batch_dim);
}

void set_tensor_dtypes(py::dict codes) {
    Py_XDECREF(tensor_reader.dtype_codes);
    tensor_reader.dtype_codes = codes.release().ptr();
}

// The attention calls take (device, tensors, options): tensors a dict slot name -> tensor (the C
// slot table, fa_tensor_slots), options a tuple of the fields of fa_option_fields in order.
struct SlotNames {
    PyObject *names[FA_SLOT_COUNT]; // interned once
    int32_t count[2];               // slots of each direction
} slot_names;                       // lives as long as the module

const char *direction_name(int32_t direction) { return direction == FA_FORWARD ? "forward" : "backward"; }

bool in_direction(int32_t slot, int32_t direction) {
    return (direction == FA_FORWARD ? fa_tensor_slots[slot].forward_offset : fa_tensor_slots[slot].backward_offset) >=
           0;
}

std::string slot_list(int32_t direction) {
    std::string names;
    for (int32_t i = 0; i < FA_SLOT_COUNT; ++i) {
        if (in_direction(i, direction)) {
            names += (names.empty() ? "" : ", ") + std::string(fa_tensor_slots[i].name);
        }
    }
    return names;
}

// Reads every slot of the direction from the dict into args (fa_forward_args or fa_backward_args);
// a missing key or None leaves the slot absent. The workspace slot is returned, not read (it may be
// a callable).
PyObject *read_tensors(py::handle tensors, void *args, int32_t direction, int32_t device, bool unbatched) {
    if (!PyDict_Check(tensors.ptr())) {
        throw py::type_error(std::string("tensors must be a dict of slot name -> tensor, got ") +
                             type_name(tensors.ptr()));
    }
    Py_ssize_t found = 0;
    PyObject *workspace = nullptr;
    for (int32_t i = 0; i < FA_SLOT_COUNT; ++i) {
        if (!in_direction(i, direction)) {
            continue;
        }
        PyObject *obj = PyDict_GetItemWithError(tensors.ptr(), slot_names.names[i]);
        if (obj == nullptr) {
            if (PyErr_Occurred()) {
                throw py::error_already_set();
            }
            continue;
        }
        ++found;
        if (i == FA_SLOT_WORKSPACE) {
            workspace = obj;
            continue;
        }
        const fa_tensor_slot &slot = fa_tensor_slots[i];
        const int32_t offset = direction == FA_FORWARD ? slot.forward_offset : slot.backward_offset;
        *reinterpret_cast<fa_tensor *>(static_cast<char *>(args) + offset) =
            to_tensor(obj, slot.name, device, unbatched && slot.batched);
    }
    if (found != PyDict_GET_SIZE(tensors.ptr())) { // a key that is no slot: name it
        PyObject *key, *value;
        Py_ssize_t pos = 0;
        while (PyDict_Next(tensors.ptr(), &pos, &key, &value)) {
            bool known = false;
            for (int32_t i = 0; i < FA_SLOT_COUNT && !known; ++i) {
                known = in_direction(i, direction) && PyUnicode_Check(key) &&
                        PyUnicode_Compare(key, slot_names.names[i]) == 0;
            }
            if (!known) {
                throw py::value_error("tensors: " + std::string(py::repr(key)) + " is not a " +
                                      direction_name(direction) + " slot; the slots are " + slot_list(direction));
            }
        }
    }
    return workspace;
}

bool is_numpy_bool(PyObject *o) {
    const std::string name = type_name(o);
    return name == "numpy.bool" || name == "numpy.bool_";
}

// options: a tuple (a NamedTuple is one) of fa_option_fields' fields in order, each type-checked.
fa_options read_options(py::handle options) {
    PyObject *o = options.ptr();
    if (!PyTuple_Check(o)) {
        throw py::type_error(std::string("options must be a tuple of ") + std::to_string(FA_OPTION_COUNT) +
                             " fields (_C.OPTION_FIELDS), got " + type_name(o));
    }
    if (PyTuple_GET_SIZE(o) != FA_OPTION_COUNT) {
        throw py::value_error("options: expected " + std::to_string(FA_OPTION_COUNT) +
                              " fields (_C.OPTION_FIELDS), got " + std::to_string(PyTuple_GET_SIZE(o)));
    }
    fa_options out = fa_default_options();
    for (int32_t i = 0; i < FA_OPTION_COUNT; ++i) {
        const fa_option_field &f = fa_option_fields[i];
        PyObject *item = PyTuple_GET_ITEM(o, i);
        char *field = reinterpret_cast<char *>(&out) + f.offset;
        const auto what = [&f]() { return std::string("options.") + f.name; }; // for messages only
        switch (f.type) {
        case FA_OPTION_DOUBLE: {
            if (PyBool_Check(item) || !(PyFloat_Check(item) || PyLong_Check(item) ||
                                        (Py_TYPE(item)->tp_as_number && Py_TYPE(item)->tp_as_number->nb_float))) {
                throw py::type_error(what() + " must be a float, got " + type_name(item));
            }
            const double value = PyFloat_AsDouble(item);
            if (value == -1.0 && PyErr_Occurred()) {
                throw py::error_already_set();
            }
            std::memcpy(field, &value, sizeof value);
            break;
        }
        case FA_OPTION_BOOL: {
            if (!(PyLong_Check(item) || is_numpy_bool(item))) { // bool is an int
                throw py::type_error(what() + " must be a bool, got " + type_name(item));
            }
            const int32_t value = PyObject_IsTrue(item);
            if (value < 0) {
                throw py::error_already_set();
            }
            std::memcpy(field, &value, sizeof value);
            break;
        }
        default: { // FA_OPTION_INT32, FA_OPTION_INT64
            if (PyBool_Check(item) || !PyIndex_Check(item) || PyFloat_Check(item)) {
                throw py::type_error(what() + " must be an int, got " + type_name(item));
            }
            py::object index = py::reinterpret_steal<py::object>(PyNumber_Index(item));
            if (!index) {
                throw py::error_already_set();
            }
            int overflow = 0;
            const long long value = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
            if (f.type == FA_OPTION_INT32) {
                if (overflow != 0 || value < INT32_MIN || value > INT32_MAX) {
                    throw py::value_error(what() + " must fit in 32 bits, got " + std::string(py::str(item)));
                }
                const int32_t v32 = static_cast<int32_t>(value);
                std::memcpy(field, &v32, sizeof v32);
            } else {
                if (overflow != 0) {
                    throw py::value_error(what() + " must fit in 64 bits, got " + std::string(py::str(item)));
                }
                const int64_t v64 = value;
                std::memcpy(field, &v64, sizeof v64);
            }
        }
        }
    }
    return out;
}

// The forward's arguments; *workspace: the workspace argument, else the dict's (a borrowed
// reference, or nullptr).
fa_forward_args forward_args(int32_t device, py::handle tensors, py::handle options, PyObject **workspace = nullptr) {
    fa_forward_args args;
    std::memset(&args, 0, sizeof args);
    args.device = device;
    args.options = read_options(options);
    PyObject *w = read_tensors(tensors, &args, FA_FORWARD, device, args.options.unbatched != 0);
    if (workspace != nullptr && (*workspace == nullptr || *workspace == Py_None)) {
        *workspace = w;
    }
    return args;
}

static bool nothing_to_run(const fa_forward_ready &ready) { return ready.empty; }
static bool nothing_to_run(const fa_backward_ready &) { return false; }

// One call per attention call, forward or backward: prepare (the plan cache) and run. A callable
// `workspace` is asked for a float32 tensor of at least n bytes, only when the plan needs one (split-K
// partials, the probabilities' pass, an additive mask's block classes); the binding keeps it alive
// while the kernels run.
template <typename Args, typename Ready>
void prepare_and_run(int32_t device, Args &args, PyObject *workspace_obj,
                     int32_t (*prepare)(const Args *, Ready *, fa_status *),
                     int32_t (*execute)(const Ready *, const Args *, fa_status *)) {
    py::handle workspace = workspace_obj != nullptr ? py::handle(workspace_obj) : py::handle(Py_None);
    const bool allocate = PyCallable_Check(workspace.ptr()) != 0;
    if (!allocate) {
        args.workspace = to_tensor(workspace, "workspace", device);
    }
    Ready ready;
    fa_status st;
    int32_t rc;
    bool needs_workspace = false;
    {
        py::gil_scoped_release release;
        rc = prepare(&args, &ready, &st);
        needs_workspace = rc == FA_OK && allocate && !nothing_to_run(ready) && ready.workspace_bytes > 0;
        if (rc == FA_OK && !needs_workspace) {
            rc = execute(&ready, &args, &st);
        }
    }
    check(rc, st);
    if (needs_workspace) {
        py::object scratch = workspace(ready.workspace_bytes);
        args.workspace = to_tensor(scratch, "workspace", device);
        {
            py::gil_scoped_release release;
            rc = execute(&ready, &args, &st);
        }
        check(rc, st);
    }
}

void forward(int32_t device, py::handle tensors, py::handle options, py::handle workspace_arg) {
    PyObject *workspace_obj = workspace_arg.ptr();
    fa_forward_args args = forward_args(device, tensors, options, &workspace_obj);
    prepare_and_run(device, args, workspace_obj, fa_forward_prepare, fa_forward_execute);
}

int64_t forward_workspace_bytes(int32_t device, py::handle tensors, py::handle options) {
    const fa_forward_args args = forward_args(device, tensors, options);
    fa_status st;
    int64_t bytes;
    {
        py::gil_scoped_release release; // may compile the pipelines
        bytes = fa_forward_workspace_bytes(&args, &st);
    }
    if (bytes < 0) {
        raise_status(st);
    }
    return bytes;
}

py::list dispatch_dicts(const fa_plan_dispatch *plan_dispatches, uint32_t n, const fa_plan_dispatch *sequence_builder,
                        int32_t gpu_family);

// The planner's decision, for tests and curiosity: kernels with their grids, function constants and
// costs (fa_dispatch_cost), the split count and the workspace size.
py::dict plan_forward(int32_t device, py::handle tensors, py::handle options) {
    const fa_forward_args args = forward_args(device, tensors, options);
    fa_plan plan;
    fa_status st;
    check(fa_plan_forward(&args, &plan, &st), st);
    // The table kernel runs first when the plan launches anything (fa_forward_execute).
    const bool builds = plan.sequences && !plan.empty && plan.n_dispatches > 0;
    return py::dict(
        py::arg("dispatches") = dispatch_dicts(plan.dispatches, plan.n_dispatches,
                                               builds ? &plan.sequence_builder : nullptr, plan.gpu_family),
        py::arg("empty") = plan.empty != 0, py::arg("gpu_family") = fa_gpu_profile_of(plan.gpu_family)->name,
        py::arg("split_count") = plan.params.split_count, py::arg("workspace_bytes") = plan.workspace_bytes);
}

// Dispatches as explain_plan shows them: kernel, macros, function constants, grid, costs; a
// sequence table's kernel (not NULL) first, as it runs.
py::list dispatch_dicts(const fa_plan_dispatch *plan_dispatches, uint32_t n, const fa_plan_dispatch *sequence_builder,
                        int32_t gpu_family) {
    const fa_gpu_profile *gpu = fa_gpu_profile_of(gpu_family);
    py::list dispatches;
    const uint32_t first = sequence_builder != nullptr ? 0 : 1;
    for (uint32_t i = first; i <= n; ++i) {
        const fa_plan_dispatch &d = i == 0 ? *sequence_builder : plan_dispatches[i - 1];
        py::dict macros;
        for (uint32_t m = 0; m < d.n_macros; ++m) {
            macros[d.macros[m].name] = d.macros[m].value;
        }
        py::dict constants, kinds; // function constants by index (FC_* of this module name some), their types
        for (uint32_t c = 0; c < d.n_constants; ++c) {
            constants[py::int_(d.constants[c].index)] = d.constants[c].i;
            kinds[py::int_(d.constants[c].index)] = d.constants[c].kind == FA_CONST_BOOL  ? "bool"
                                                    : d.constants[c].kind == FA_CONST_INT ? "int"
                                                                                          : "float";
        }
        const fa_dispatch_cost &c = d.cost;
        py::dict cost(py::arg("threadgroup_bytes") = c.threadgroup_bytes, py::arg("registers") = c.registers,
                      py::arg("flops") = c.flops, py::arg("tiles") = c.tiles, py::arg("useful_flops") = c.useful_flops,
                      py::arg("min_bytes_read") = c.min_bytes_read, py::arg("min_bytes_written") = c.min_bytes_written);
        const uint32_t threads = d.threadgroup[0] * d.threadgroup[1] * d.threadgroup[2];
        const fa_gpu_estimate e =
            fa_gpu_estimate_dispatch(gpu, c.registers, c.threadgroup_bytes, threads, c.flops, c.useful_flops);
        py::dict estimate(
            py::arg("gpu_family") = gpu->name, py::arg("registers") = e.registers,
            py::arg("fragment_registers") = c.registers, py::arg("threadgroup_bytes") = c.threadgroup_bytes,
            py::arg("resident_threadgroups") = e.resident_threadgroups,
            py::arg("resident_simd_groups") = e.resident_simd_groups, py::arg("occupancy") = e.occupancy,
            py::arg("fraction_of_peak") = e.fraction_of_peak,
            py::arg("fraction_of_bandwidth") =
                fa_gpu_bandwidth_fraction(gpu, d.issue_slots, (double)(c.min_bytes_read + c.min_bytes_written)),
            py::arg("assumptions") = FA_GPU_ESTIMATE_ASSUMPTIONS "; " FA_GPU_BANDWIDTH_ASSUMPTIONS);
        dispatches.append(
            py::dict(py::arg("source") = d.source_name, py::arg("function") = d.function, py::arg("macros") = macros,
                     py::arg("constants") = constants, py::arg("constant_kinds") = kinds,
                     py::arg("grid") = py::make_tuple(d.grid[0], d.grid[1], d.grid[2]),
                     py::arg("threadgroup") = py::make_tuple(d.threadgroup[0], d.threadgroup[1], d.threadgroup[2]),
                     py::arg("cost") = cost, py::arg("estimate") = estimate));
    }
    return dispatches;
}

// The backward's arguments; *workspace as forward_args'.
fa_backward_args backward_args(int32_t device, py::handle tensors, py::handle options, PyObject **workspace = nullptr) {
    fa_backward_args args;
    std::memset(&args, 0, sizeof args);
    args.device = device;
    args.options = read_options(options);
    PyObject *w = read_tensors(tensors, &args, FA_BACKWARD, device, args.options.unbatched != 0);
    if (workspace != nullptr && (*workspace == nullptr || *workspace == Py_None)) {
        *workspace = w;
    }
    return args;
}

void backward(int32_t device, py::handle tensors, py::handle options, py::handle workspace_arg) {
    PyObject *workspace_obj = workspace_arg.ptr();
    fa_backward_args args = backward_args(device, tensors, options, &workspace_obj);
    prepare_and_run(device, args, workspace_obj, fa_backward_prepare, fa_backward_execute);
}

// The backward's three dispatches with their costs (explain_plan(backward=True)).
py::list plan_backward(int32_t device, py::handle tensors, py::handle options, py::handle /* workspace */) {
    const fa_backward_args args = backward_args(device, tensors, options);
    fa_backward_plan plan;
    fa_status st;
    check(fa_plan_backward(&args, &plan, &st), st);
    const bool builds = plan.sequences && plan.params.forward.batch > 0; // fa_backward_execute
    fa_plan_dispatch planned[FA_BACKWARD_DISPATCHES]; // without the mask's block pass when it has none
    uint32_t n = 0;
    for (uint32_t i = 0; i < FA_BACKWARD_DISPATCHES; ++i) {
        if (plan.dispatches[i].function[0] != '\0') {
            planned[n++] = plan.dispatches[i];
        }
    }
    return dispatch_dicts(planned, n, builds ? &plan.sequence_builder : nullptr, plan.gpu_family);
}

// The name of the GPU family a call on `device` plans for (fa_resolve_gpu_family): explain_plan
// reports it even when nothing is planned (an empty call).
std::string gpu_family_name(int32_t device, int64_t requested) {
    int32_t family = 0;
    fa_status st;
    check(fa_resolve_gpu_family(device, requested, &family, &st), st);
    return fa_gpu_profile_of(family)->name;
}

void register_source(const std::string &name, const std::string &text) {
    fa_status st;
    check(fa_register_source(name.c_str(), text.c_str(), &st), st);
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

} // namespace

PYBIND11_MODULE(_C, m) {
    m.doc() = "flashattn-mps C core (internal; use flashattn_mps)";
    // The CPU Metal device: its exception types (raised by both modules) and its table for CPU
    // tensors (cpu_backend.c).
    py::module_ device = py::module_::import("flashattn_mps._metal_cpu");
    compile_error_type = py::object(device.attr("MetalCompileError")).release().ptr();
    dispatch_error_type = py::object(device.attr("MetalDispatchError")).release().ptr();
    {
        fa_status st;
        void *api = PyCapsule_Import(MCPU_API_CAPSULE, 0);
        if (api == nullptr) {
            throw py::error_already_set();
        }
        check(fa_cpu_backend_attach(api, &st), st);
    }
    m.attr("MetalCompileError") = py::handle(compile_error_type);
    m.attr("MetalDispatchError") = py::handle(dispatch_error_type);

    m.attr("DTYPE_FLOAT32") = static_cast<int>(FA_F32);
    m.attr("DTYPE_FLOAT16") = static_cast<int>(FA_F16);
    m.attr("DTYPE_BFLOAT16") = static_cast<int>(FA_BF16);
    m.attr("DTYPE_BOOL") = static_cast<int>(FA_BOOL);
    m.attr("DTYPE_INT32") = static_cast<int>(FA_I32);
    m.attr("DTYPE_UINT8") = static_cast<int>(FA_U8);
    m.attr("MAX_HEAD_DIM") = static_cast<int>(FA_MAX_HEAD_DIM);            // E and Ev alike
    m.attr("SEQUENCE_PARAMS_BYTES") = static_cast<int>(sizeof(fa_params)); // per sequence (fa_sequence_args)
    m.attr("DEVICE_CPU") = static_cast<int>(FA_DEVICE_CPU);
    m.attr("DEVICE_MPS") = static_cast<int>(FA_DEVICE_MPS);
    m.attr("KERNEL_AUTO") = static_cast<int>(FA_KERNEL_AUTO);
    m.attr("KERNEL_SIMPLE") = static_cast<int>(FA_KERNEL_SIMPLE);
    m.attr("KERNEL_FORWARD") = static_cast<int>(FA_KERNEL_FORWARD);
    m.attr("KERNEL_DECODE") = static_cast<int>(FA_KERNEL_DECODE);
    m.attr("KERNEL_TENSOR") = static_cast<int>(FA_KERNEL_TENSOR);
    m.attr("CONSTANT_BOOL") = static_cast<int>(MSL_CONSTANT_BOOL);
    m.attr("CONSTANT_INT") = static_cast<int>(MSL_CONSTANT_INT);
    m.attr("CONSTANT_FLOAT") = static_cast<int>(MSL_CONSTANT_FLOAT);
    m.attr("FC_DECODE_VECTOR_LOADS") = static_cast<int>(FA_FC_DECODE_VECTOR_LOADS);
    m.attr("FC_DROPOUT") = static_cast<int>(FA_FC_DROPOUT);
    m.attr("FC_K_BITS") = static_cast<int>(FA_FC_K_BITS);
    m.attr("FC_V_BITS") = static_cast<int>(FA_FC_V_BITS);
    m.attr("FC_MASK_BLOCKS") = static_cast<int>(FA_FC_MASK_BLOCKS);
    m.attr("DROPOUT_NONE") = static_cast<int>(FA_DROPOUT_NONE);
    m.attr("DROPOUT_APPLY") = static_cast<int>(FA_DROPOUT_APPLY);
    m.attr("DROPOUT_PROBS") = static_cast<int>(FA_DROPOUT_PROBS);
#if defined(__APPLE__)
    m.attr("HAS_METAL_BACKEND") = true;
#else
    m.attr("HAS_METAL_BACKEND") = false;
#endif

    tensor_reader =
        TensorReader{PyUnicode_InternFromString("untyped_storage"), PyUnicode_InternFromString("data_ptr"),
                     PyUnicode_InternFromString("nbytes"),          PyUnicode_InternFromString("storage_offset"),
                     PyUnicode_InternFromString("dtype"),           PyUnicode_InternFromString("shape"),
                     PyUnicode_InternFromString("stride"),          PyUnicode_InternFromString("is_cpu"),
                     PyUnicode_InternFromString("is_mps")};
    m.def("set_tensor_dtypes", &set_tensor_dtypes, py::arg("codes"),
          "{torch dtype: DTYPE_* code}: how torch.Tensor arguments are read");
    py::list option_fields, forward_slots, backward_slots;
    for (int32_t i = 0; i < FA_OPTION_COUNT; ++i) {
        option_fields.append(fa_option_fields[i].name);
    }
    for (int32_t i = 0; i < FA_SLOT_COUNT; ++i) {
        slot_names.names[i] = PyUnicode_InternFromString(fa_tensor_slots[i].name);
        if (in_direction(i, FA_FORWARD)) {
            forward_slots.append(fa_tensor_slots[i].name);
        }
        if (in_direction(i, FA_BACKWARD)) {
            backward_slots.append(fa_tensor_slots[i].name);
        }
    }
    m.attr("OPTION_FIELDS") = py::tuple(option_fields);
    m.attr("FORWARD_SLOTS") = py::tuple(forward_slots);
    m.attr("BACKWARD_SLOTS") = py::tuple(backward_slots);
    m.def("forward", &forward,
          "Validate, plan (cached) and run attention. tensors: {slot name (FORWARD_SLOTS): torch.Tensor, 6-field "
          "descriptor or None}; options: a tuple of OPTION_FIELDS; workspace None, a float32 tensor or a callable "
          "returning one of at least n bytes (else the tensors' workspace)",
          py::arg("device"), py::arg("tensors"), py::arg("options"), py::arg("workspace") = py::none());
    m.def("forward_workspace_bytes", &forward_workspace_bytes,
          "Bytes of workspace forward needs for these tensors and options", py::arg("device"), py::arg("tensors"),
          py::arg("options"));
    m.def("plan_forward", &plan_forward, "The plan forward would run: dispatches, split count, workspace bytes",
          py::arg("device"), py::arg("tensors"), py::arg("options"));
    m.def("backward", &backward,
          "Gradients of forward: dq, dk, dv from q, k, v, out, lse and dout (BACKWARD_SLOTS); delta is (B, Hq, L) "
          "float32 scratch; workspace as forward's (the additive mask's block classes; without one the mask is "
          "added everywhere)",
          py::arg("device"), py::arg("tensors"), py::arg("options"), py::arg("workspace") = py::none());
    m.def("plan_backward", &plan_backward,
          "The backward's dispatches with their costs (arguments as for backward; the workspace is not looked at)",
          py::arg("device"), py::arg("tensors"), py::arg("options"), py::arg("workspace") = py::none());
    m.def("gpu_family_name", &gpu_family_name, "The GPU family a call plans for (requested 0: the device's)",
          py::arg("device"), py::arg("requested"));
    m.def("device_tensor_family", &fa_device_tensor_family,
          "The family whose Metal 4 tensor operations the device runs (9 or 10), 0 without them", py::arg("device"));
    m.def(
        "plan_cache_counts",
        []() {
            int64_t c[4];
            fa_plan_cache_counts(c);
            return py::dict(py::arg("forward_hits") = c[0], py::arg("forward_misses") = c[1],
                            py::arg("backward_hits") = c[2], py::arg("backward_misses") = c[3]);
        },
        "How the plan cache answered so far: hits and misses (planned afresh) of each direction");
    m.def("backend_builds", &fa_cache_entries_stored,
          "Libraries compiled and pipelines built by the backends so far (entries stored in their caches)");
    m.def("register_source", &register_source, py::arg("name"), py::arg("text"));
    m.def("specialisations", &specialisations);

    add_metal_bindings(m, raise_status);
}
