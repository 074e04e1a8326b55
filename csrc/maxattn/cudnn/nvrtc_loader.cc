// NVRTC entry points used by cudnn-frontend's experimental open-source engines
// (never by the SDPA graphs of this backend). Linking libnvrtc would add a
// hard run-time dependency that JAX's CUDA plugin does not guarantee on the
// loader path, so these definitions load it lazily with dlopen and report
// NVRTC_ERROR_INTERNAL_ERROR when it is absent. Hidden: they never interpose
// on another library's NVRTC.
#include <dlfcn.h>
#include <nvrtc.h>

#include <mutex>

namespace {

void* Nvrtc() {
  static void* handle = [] {
    for (const char* name : {"libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"}) {
      if (void* h = dlopen(name, RTLD_NOW | RTLD_LOCAL)) return h;
    }
    return static_cast<void*>(nullptr);
  }();
  return handle;
}

template <typename Fn>
Fn Resolve(const char* symbol) {
  void* lib = Nvrtc();
  return lib ? reinterpret_cast<Fn>(dlsym(lib, symbol)) : nullptr;
}

}  // namespace

#define MAXATTN_NVRTC_FORWARD(name, params, args)                             \
  extern "C" __attribute__((visibility("hidden"))) nvrtcResult name params { \
    using Fn = nvrtcResult(*) params;                                         \
    static Fn fn = Resolve<Fn>(#name);                                        \
    return fn ? fn args : NVRTC_ERROR_INTERNAL_ERROR;                         \
  }

MAXATTN_NVRTC_FORWARD(nvrtcCreateProgram,
                      (nvrtcProgram * prog, const char* src, const char* name, int num_headers,
                       const char* const* headers, const char* const* include_names),
                      (prog, src, name, num_headers, headers, include_names))
MAXATTN_NVRTC_FORWARD(nvrtcCompileProgram, (nvrtcProgram prog, int num_options, const char* const* options),
                      (prog, num_options, options))
MAXATTN_NVRTC_FORWARD(nvrtcDestroyProgram, (nvrtcProgram * prog), (prog))
MAXATTN_NVRTC_FORWARD(nvrtcGetCUBIN, (nvrtcProgram prog, char* cubin), (prog, cubin))
MAXATTN_NVRTC_FORWARD(nvrtcGetCUBINSize, (nvrtcProgram prog, size_t* size), (prog, size))
MAXATTN_NVRTC_FORWARD(nvrtcGetProgramLog, (nvrtcProgram prog, char* log), (prog, log))
MAXATTN_NVRTC_FORWARD(nvrtcGetProgramLogSize, (nvrtcProgram prog, size_t* size), (prog, size))
// cudnn-frontend < 1.29 also asks for PTX (its headers reference these even when unused).
MAXATTN_NVRTC_FORWARD(nvrtcGetPTX, (nvrtcProgram prog, char* ptx), (prog, ptx))
MAXATTN_NVRTC_FORWARD(nvrtcGetPTXSize, (nvrtcProgram prog, size_t* size), (prog, size))
