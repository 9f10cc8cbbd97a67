// SP_HOST_DEVICE: a function that host code and device code both call (geometry, the key basis, the block
// schedule). Under nvcc it is __host__ __device__ and inlined; for the host compiler (the CPU reference, the
// binding) it is a plain inline function, so these headers need no CUDA.
#pragma once

#if defined(__CUDACC__)
#define SP_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define SP_HOST_DEVICE inline
#endif
