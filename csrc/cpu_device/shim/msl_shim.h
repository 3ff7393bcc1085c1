/* Force-included (-include msl_shim.h) into every MSL source compiled for the CPU Metal device.
 * The source reaching the compiler was already preprocessed and rewritten by prepass.c, so these
 * macros only meet Metal's keywords, not the user's own macros.
 * With MSL_STRICT defined (the strict check, clang -fsyntax-only) the address spaces are real
 * clang address spaces, so mixing device, constant and threadgroup pointers fails as on a Mac. */
#ifndef MSL_SHIM_H
#define MSL_SHIM_H

#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "msl_abi.h"

#ifndef __METAL_VERSION__
#define __METAL_VERSION__ 310
#endif
#ifndef __HAVE_BFLOAT__
#define __HAVE_BFLOAT__ 1
#endif

#ifdef MSL_STRICT
#define MSL_DEVICE __attribute__((address_space(1)))
#define MSL_CONSTANT __attribute__((address_space(2)))
#define MSL_THREADGROUP __attribute__((address_space(3)))
#define constant MSL_CONSTANT
#else
/* The executed build (clang with -fsycl-is-device, build.c): three distinct language address
 * spaces, so overloads and partial specialisations on them stay apart and conversions between them
 * are refused as in Metal, while each converts implicitly to the default (thread) one: the shim's
 * own member functions and copies reach objects in any address space. constant memory is const. */
#define MSL_DEVICE __attribute__((opencl_global_device))
#define MSL_CONSTANT __attribute__((opencl_global_host))
#define MSL_THREADGROUP __attribute__((opencl_local))
#define constant MSL_CONSTANT const
#endif
#define device MSL_DEVICE
#define threadgroup MSL_THREADGROUP
#define thread
#define kernel
/* from Apple's <metal_stdlib>, whose stand-in is empty: kept by the -E step, expanded here */
#define METAL_FUNC inline

#include "msl_types.h"
#include "msl_math.h"
#include "msl_sync.h"
#include "msl_kernel.h"
#if __METAL_VERSION__ >= 400
#include "msl_tensor.h"
#endif

#endif
