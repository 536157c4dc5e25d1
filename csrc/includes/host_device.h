// host_device.h: one macro so per-element math compiles for both the CPU kernels (g++) and CUDA (nvcc).
#pragma once

#if defined(__CUDACC__) || defined(__HIPCC__)
#define DS_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define DS_HOST_DEVICE inline
#endif
