# All dependencies are Debian packages (see .ci/install-deps.sh); nothing is downloaded at build time.
find_package(Threads REQUIRED)
find_package(fmt REQUIRED)
find_package(hwy REQUIRED)
find_package(CLI11 REQUIRED)
find_package(nlohmann_json REQUIRED)
find_package(PkgConfig REQUIRED)
find_package(pugixml REQUIRED)                              # MSCCL XML (compiler), NCCL topology XML
pkg_check_modules(HWLOC REQUIRED IMPORTED_TARGET hwloc)    # topology detection

# CUDA: AUTO turns it on when nvcc is found (under /usr/local/cuda on our machines). The code must
# compile without a GPU; tests that need a device skip themselves at run time.
set(TUTTI_CUDA_ENABLED OFF)
if(NOT TUTTI_WITH_CUDA STREQUAL "OFF")
  if(NOT CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 90)  # Hopper (H100/H200), the GPUs we can borrow
    endif()
    enable_language(CUDA)
    set(CMAKE_CUDA_STANDARD 17)  # CMake 3.25 does not know nvcc 13 speaks C++20; device code needs only 17
    set(CMAKE_CUDA_STANDARD_REQUIRED ON)
    find_package(CUDAToolkit REQUIRED)
    set(TUTTI_CUDA_ENABLED ON)
  elseif(TUTTI_WITH_CUDA STREQUAL "ON")
    message(FATAL_ERROR "TUTTI_WITH_CUDA=ON but no CUDA compiler was found")
  endif()
endif()

set(TUTTI_IBVERBS_ENABLED OFF)
if(NOT TUTTI_WITH_IBVERBS STREQUAL "OFF")
  pkg_check_modules(IBVERBS IMPORTED_TARGET libibverbs)
  if(IBVERBS_FOUND)
    set(TUTTI_IBVERBS_ENABLED ON)
  elseif(TUTTI_WITH_IBVERBS STREQUAL "ON")
    message(FATAL_ERROR "TUTTI_WITH_IBVERBS=ON but libibverbs was not found")
  endif()
endif()

# The trainer: OpenBLAS (GEMMs), OpenMP (its other loops), zlib (the Jargon File ships gzipped).
pkg_check_modules(OPENBLAS REQUIRED IMPORTED_TARGET openblas)
find_package(OpenMP REQUIRED COMPONENTS CXX)
find_package(ZLIB REQUIRED)
find_package(OpenSSL REQUIRED COMPONENTS Crypto)  # HMAC-SHA256 for the bootstrap's challenge-response
