# CUTLASS / CuTe C++ headers for the sm90 kernels (csrc/maxattn/sm90/), and
# the targets that need them. Header-only, pinned to the PyPI wheel
# nvidia-cutlass==4.2.0.0 (headers under cutlass_library/source/include).
#
# Where the headers come from, first match wins:
#   1. -DMAXATTN_CUTLASS_INCLUDE_DIR=<dir holding cute/ and cutlass/>
#   2. <repo>/.cutlass/include (ignored folder; unpack the wheel's include dir there)
#   3. the installed Python package cutlass_library: <package>/source/include
#
# MAXATTN_SM90_HARNESS=ON builds maxattn_sm90 (the kernels, sm_90a only) and the
# standalone harness tests/cuda/sm90_fwd_harness; it needs nvcc and the headers.
set(MAXATTN_CUTLASS_PINNED_VERSION "4.2.0")
option(MAXATTN_SM90_HARNESS "Build the sm90 kernels and their standalone harness (needs nvcc, CUTLASS headers)" OFF)
# MAXATTN_SM90: the sm90 kernels inside the CUDA extension module (implementation="sm90").
# AUTO builds them whenever the cuDNN module is built and the CUTLASS headers are found.
set(MAXATTN_SM90 AUTO CACHE STRING "Build the sm90 kernels into _maxattn_cuda (AUTO, ON or OFF)")

set(maxattn_py_cutlass "")
if(NOT MAXATTN_CUTLASS_INCLUDE_DIR)
  find_package(Python 3.10 QUIET COMPONENTS Interpreter)
  if(Python_Interpreter_FOUND)
    execute_process(
      COMMAND "${Python_EXECUTABLE}" -c
              "import importlib.util as u, os; s = u.find_spec('cutlass_library'); print(os.path.join(os.path.dirname(s.origin), 'source', 'include') if s and s.origin else '')"
      OUTPUT_VARIABLE maxattn_py_cutlass OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  endif()
endif()
find_path(MAXATTN_CUTLASS_INCLUDE_DIR cute/tensor.hpp
  HINTS ${PROJECT_SOURCE_DIR}/.cutlass/include ${maxattn_py_cutlass} NO_DEFAULT_PATH
  DOC "Folder holding the CUTLASS headers cute/ and cutlass/")

if(MAXATTN_CUTLASS_INCLUDE_DIR)
  file(STRINGS "${MAXATTN_CUTLASS_INCLUDE_DIR}/cutlass/version.h" maxattn_cutlass_version_lines
       REGEX "#define CUTLASS_(MAJOR|MINOR|PATCH) ")
  set(maxattn_cutlass_version "")
  foreach(part MAJOR MINOR PATCH)
    foreach(line ${maxattn_cutlass_version_lines})
      if(line MATCHES "#define CUTLASS_${part} ([0-9]+)")
        list(APPEND maxattn_cutlass_version ${CMAKE_MATCH_1})
      endif()
    endforeach()
  endforeach()
  list(JOIN maxattn_cutlass_version "." maxattn_cutlass_version)
  if(NOT maxattn_cutlass_version STREQUAL MAXATTN_CUTLASS_PINNED_VERSION)
    message(WARNING "maxattn: CUTLASS headers in ${MAXATTN_CUTLASS_INCLUDE_DIR} are version "
                    "${maxattn_cutlass_version}; the sm90 kernels are pinned to ${MAXATTN_CUTLASS_PINNED_VERSION}")
  endif()
endif()

if(MAXATTN_SM90_HARNESS)
  if(NOT MAXATTN_CUTLASS_INCLUDE_DIR)
    message(FATAL_ERROR "MAXATTN_SM90_HARNESS=ON needs the CUTLASS headers: pip download --no-deps "
                        "nvidia-cutlass==4.2.0.0 and unpack cutlass_library/source/include into .cutlass/include, "
                        "or set MAXATTN_CUTLASS_INCLUDE_DIR")
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(NOT CMAKE_CUDA_COMPILER)
    message(FATAL_ERROR "MAXATTN_SM90_HARNESS=ON needs nvcc")
  endif()
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
    set(CMAKE_CUDA_ARCHITECTURES OFF)  # the sm90 targets pass -gencode for sm_90a themselves
  endif()
  enable_language(CUDA)
  find_package(CUDAToolkit REQUIRED)
  message(STATUS "maxattn: sm90 kernels and harness with CUTLASS ${maxattn_cutlass_version} "
                 "(${MAXATTN_CUTLASS_INCLUDE_DIR})")
  add_subdirectory(${PROJECT_SOURCE_DIR}/csrc/maxattn/sm90 ${PROJECT_BINARY_DIR}/csrc/maxattn/sm90)
  add_subdirectory(${PROJECT_SOURCE_DIR}/tests/cuda ${PROJECT_BINARY_DIR}/tests/cuda)
endif()
