// The one place that maps fastpar::cuda::DType to device types and converts them to and from fp32.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "bucket_kernels.h"

namespace fastpar::cuda {

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// Round to nearest even, like torch's CPU casts, so results match the CPU reference bit for bit.
template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

}  // namespace fastpar::cuda

// Runs the statements with `T` bound to the device type of `dtype`; usable in host and device code.
#define FASTPAR_DISPATCH_DTYPE(dtype, T, ...)          \
  switch (dtype) {                                      \
    case ::fastpar::cuda::DType::kFloat32: {            \
      using T = float;                                  \
      __VA_ARGS__;                                      \
    } break;                                            \
    case ::fastpar::cuda::DType::kFloat16: {            \
      using T = __half;                                 \
      __VA_ARGS__;                                      \
    } break;                                            \
    case ::fastpar::cuda::DType::kBFloat16: {           \
      using T = __nv_bfloat16;                          \
      __VA_ARGS__;                                      \
    } break;                                            \
  }
