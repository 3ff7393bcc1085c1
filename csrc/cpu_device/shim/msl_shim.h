/* Force-included (-include msl_shim.h) into every MSL source compiled for the CPU Metal device.
 * The source reaching the compiler was already preprocessed and rewritten by prepass.c, so these
 * macros only meet Metal's keywords, not the user's own macros.
 * With MSL_STRICT defined (the strict check, clang -fsyntax-only) the address spaces are real
 * clang address spaces, so mixing device, constant and threadgroup pointers fails as on a Mac. */
#ifndef MSL_SHIM_H
#define MSL_SHIM_H

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
#define device __attribute__((address_space(1)))
#define constant __attribute__((address_space(2)))
#define threadgroup __attribute__((address_space(3)))
#else
#define device
#define constant const
#define threadgroup
#endif
#define thread
#define kernel
/* from Apple's <metal_stdlib>, whose stand-in is empty: kept by the -E step, expanded here */
#define METAL_FUNC inline

#include "msl_types.h"
#include "msl_math.h"
#include "msl_sync.h"
#include "msl_kernel.h"

#endif
