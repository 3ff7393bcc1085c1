// The Metal backend's controls for Python (flashattn_mps._metal_mode, flashattn_mps.doctor). Built
// on every system: elsewhere than macOS the C functions report that Metal is unavailable.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

extern "C" {
#include "../metal_backend/metal_backend.h"
}

namespace py = pybind11;

void add_metal_bindings(py::module_ &m, void (*raise_status)(const fa_status &)) {
    m.attr("METAL_OWN_QUEUE") = static_cast<int>(FA_METAL_OWN_QUEUE);
    m.attr("METAL_TORCH_STREAM") = static_cast<int>(FA_METAL_TORCH_STREAM);
    m.attr("METAL_TORCH_STREAM_END_COALESCING") = static_cast<int>(FA_METAL_TORCH_STREAM_END_COALESCING);

    m.def(
        "metal_torch_symbols",
        [] {
            const uint32_t found = fa_metal_torch_symbols();
            py::dict out; // in metal_backend.h's order
            for (int32_t i = 0; i < FA_TORCH_N_SYMBOLS; ++i) {
                out[fa_metal_torch_symbol_name(i)] = ((found >> i) & 1u) != 0;
            }
            return out;
        },
        "torch's symbols the Metal backend resolves at run time (resolving them again): {mangled name: found}");
    m.def("metal_configure", &fa_metal_configure, py::arg("mode"), py::arg("debug"), py::arg("check_buffers"),
          "Sets the stream mode (METAL_*), the debug switch and the buffer check; returns the mode in effect");
    m.def(
        "metal_device_info",
        [raise_status]() -> py::dict {
            fa_metal_device_info info;
            fa_status st;
            if (fa_metal_device_info_get(&info, &st) != FA_OK) {
                raise_status(st);
            }
            static const std::pair<uint32_t, const char *> family_names[] = {{FA_GPU_APPLE7, "Apple7"},
                                                                             {FA_GPU_APPLE8, "Apple8"},
                                                                             {FA_GPU_APPLE9, "Apple9"},
                                                                             {FA_GPU_MAC2, "Mac2"},
                                                                             {FA_GPU_METAL3, "Metal3"}};
            py::dict families;
            for (const auto &f : family_names) {
                families[f.second] = (info.families & f.first) != 0;
            }
            static const char *const chosen_by[] = {"", "torch's MPS command buffer",
                                                    "MTLCopyAllDevices(), first non-low-power",
                                                    "MTLCreateSystemDefaultDevice()"};
            const bool known = info.chosen_by >= 1 && info.chosen_by <= 3;
            return py::dict(
                py::arg("name") = std::string(info.name), py::arg("registry_id") = info.registry_id,
                py::arg("chosen_by") = std::string(known ? chosen_by[info.chosen_by] : "unknown"),
                py::arg("low_power") = info.low_power != 0, py::arg("families") = families,
                py::arg("max_threadgroup_memory") = info.max_threadgroup_memory,
                py::arg("torch_registry_id") =
                    info.torch_device_known ? py::object(py::int_(info.torch_registry_id)) : py::object(py::none()),
                py::arg("language_version") = info.language_version, py::arg("fast_math") = info.fast_math != 0,
                py::arg("math_mode") = info.math_mode, py::arg("math_fp32_functions") = info.math_fp32_functions,
                py::arg("stream_mode") = info.stream_mode, py::arg("debug") = info.debug != 0,
                py::arg("check_buffers") = info.check_buffers != 0);
        },
        "The Metal device chosen, how, its families, torch's device and the compile options in effect");
    m.def(
        "metal_pipeline_info",
        [raise_status](const std::string &source, const std::string &function,
                       const std::vector<std::pair<std::string, std::string>> &macros,
                       const std::vector<std::tuple<uint32_t, std::string, double>> &constants) -> py::dict {
            if (macros.size() > FA_MAX_MACROS || constants.size() > FA_MAX_CONSTANTS) {
                throw py::value_error("metal_pipeline_info: at most " + std::to_string(FA_MAX_MACROS) + " macros and " +
                                      std::to_string(FA_MAX_CONSTANTS) + " constants");
            }
            std::vector<fa_macro> key_macros(macros.size());
            for (size_t i = 0; i < macros.size(); ++i) {
                if (macros[i].first.size() >= sizeof key_macros[i].name ||
                    macros[i].second.size() >= sizeof key_macros[i].value) {
                    throw py::value_error("metal_pipeline_info: macro " + macros[i].first + " is too long");
                }
                std::memset(&key_macros[i], 0, sizeof key_macros[i]);
                std::memcpy(key_macros[i].name, macros[i].first.data(), macros[i].first.size());
                std::memcpy(key_macros[i].value, macros[i].second.data(), macros[i].second.size());
            }
            std::vector<fa_constant> key_constants(constants.size());
            for (size_t i = 0; i < constants.size(); ++i) {
                const std::string &kind = std::get<1>(constants[i]);
                const double value = std::get<2>(constants[i]);
                if (kind != "bool" && kind != "int" && kind != "float") {
                    throw py::value_error("metal_pipeline_info: a constant's kind is bool, int or float, got " + kind);
                }
                key_constants[i] = fa_constant{std::get<0>(constants[i]),
                                               kind == "bool"  ? FA_CONST_BOOL
                                               : kind == "int" ? FA_CONST_INT
                                                               : FA_CONST_FLOAT,
                                               static_cast<int64_t>(value), value};
            }
            const fa_pipeline_key key = {source.c_str(),       function.c_str(),
                                         key_macros.data(),    static_cast<uint32_t>(key_macros.size()),
                                         key_constants.data(), static_cast<uint32_t>(key_constants.size())};
            fa_metal_pipeline_info info;
            fa_status st;
            if (fa_metal_pipeline_info_get(&key, &info, &st) != FA_OK) {
                raise_status(st);
            }
            return py::dict(py::arg("max_total_threads_per_threadgroup") = info.max_total_threads_per_threadgroup,
                            py::arg("static_threadgroup_memory_length") = info.static_threadgroup_memory_length,
                            py::arg("thread_execution_width") = info.thread_execution_width);
        },
        py::arg("source"), py::arg("function"), py::arg("macros"), py::arg("constants"),
        "Builds a pipeline on Metal as a dispatch would ((index, kind, value) constants) and returns what Metal "
        "decided for it; MetalCompileError with Metal's message, or MetalDispatchError off macOS");
    m.def(
        "metal_object_class",
        [](uintptr_t handle) {
            char name[256];
            fa_metal_object_class(reinterpret_cast<void *>(handle), name, sizeof name);
            return std::string(name);
        },
        py::arg("handle"), "The Objective-C class of an MPS storage handle ('' if it is not an object)");
    m.def(
        "metal_check_buffer",
        [raise_status](uintptr_t handle, int64_t needed_bytes) {
            fa_status st;
            if (fa_metal_check_buffer(reinterpret_cast<void *>(handle), needed_bytes, &st) != FA_OK) {
                raise_status(st);
            }
        },
        py::arg("handle"), py::arg("needed_bytes"), "The backend's buffer check; raises TypeError when it rejects");
}
