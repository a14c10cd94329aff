#pragma once
// Reductions on device memory with the same per-element semantics as the CPU kernels
// (core/element.hpp), the first piece of the CUDA executor. Built only when TUTTI_WITH_CUDA is on;
// without a GPU the functions report that no device is there rather than failing to link.

#include <cstddef>

#include "core/datatype.hpp"

namespace tutti::cuda {

// Number of CUDA devices this process can use (0 when there is no driver or no device).
int device_count();

// dst = a (op) b on device pointers, on the default stream, synchronously. Throws InvalidArgument
// for bad type/op and SystemError-kind errors with the CUDA message on a CUDA failure.
void combine(RedOp op, DataType type, void* dst, const void* a, const void* b, size_t count);

}  // namespace tutti::cuda
