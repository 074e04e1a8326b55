"""What this maxattn install can run, and why a backend is unavailable.

``maxattn.show_config()`` and ``python -m maxattn.info`` print it. The facts
come from three places:

* the extension modules themselves (imported here the same way the backends
  import them: the CUDA module only once JAX's GPU backend is up, so that the
  ``libcudnn.so.9`` of JAX's CUDA plugin is already loaded);
* ``maxattn/_build_info.json``, written by CMake into the package at build
  time: whether the cuDNN module was built and, if not, what was missing, and
  the cuDNN / CUDA versions it was compiled against;
* the installed distributions (jax, jaxlib, the CUDA plugin, nvidia-cudnn).

This module depends on no other part of ``maxattn._src``, so it still works
(and says why) when the package is half-built.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import sys
from typing import Any, Optional, TextIO

__all__ = ["collect", "show_config"]

_CPU_MODULE = "maxattn._maxattn_cpu"
_CUDA_MODULE = "maxattn._maxattn_cuda"


def _dist_version(*names: str) -> Optional[str]:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _format_cudnn(v: Optional[int]) -> Optional[str]:
    """91900 -> '9.19.0' (cuDNN >= 9 encodes major*10000 + minor*100 + patch)."""
    if v is None:
        return None
    v = int(v)
    return f"{v // 10000}.{(v % 10000) // 100}.{v % 100}"


def _build_info() -> dict:
    """The JSON CMake wrote next to the modules; {} when absent (a source tree)."""
    import maxattn
    path = os.path.join(os.path.dirname(maxattn.__file__), "_build_info.json")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _module_file(name: str) -> Optional[str]:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    return spec.origin if spec is not None else None


def _jax_devices(platform_name: str) -> list:
    import jax
    try:
        return list(jax.devices(platform_name))
    except RuntimeError:
        return []


def _cpu_backend() -> dict:
    entry: dict[str, Any] = {"built": _module_file(_CPU_MODULE) is not None, "available": False,
                             "reason": None}
    try:
        importlib.import_module(_CPU_MODULE)
    except ImportError as e:
        entry["reason"] = (f"the CPU extension module could not be imported ({e})" if entry["built"]
                           else "the CPU extension module was not built (maxattn/_maxattn_cpu*.so is missing)")
        return entry
    entry["available"] = True
    return entry


def _cuda_backend(build: dict) -> dict:
    entry: dict[str, Any] = {"built": _module_file(_CUDA_MODULE) is not None, "available": False,
                             "reason": None, "cudnn_compiled": build.get("cudnn_header_version") or None,
                             "cudnn_runtime": None}
    if not entry["built"]:
        why = build.get("cuda_missing")
        setting = build.get("maxattn_cuda")
        if setting == "OFF":
            entry["reason"] = "the cuDNN module was not built (MAXATTN_CUDA=OFF at build time)"
        elif why:
            entry["reason"] = f"the cuDNN module was not built; missing at build time: {why}"
        else:
            entry["reason"] = "the cuDNN module was not built (maxattn/_maxattn_cuda*.so is missing)"
        return entry
    if not _jax_devices("gpu"):
        entry["reason"] = "JAX has no GPU backend (the cudnn backend needs a CUDA GPU and jax[cuda13])"
        return entry
    try:
        module = importlib.import_module(_CUDA_MODULE)
    except ImportError as e:
        entry["reason"] = f"the cuDNN extension module could not be imported ({e})"
        return entry
    entry["available"] = True
    entry["cudnn_runtime"] = _format_cudnn(module.cudnn_version())
    compiled = getattr(module, "cudnn_compiled_version", None)
    if compiled is not None:
        entry["cudnn_compiled"] = _format_cudnn(compiled())
    return entry


def _sm90_backend(cuda: dict) -> dict:
    """Our Hopper kernels live in the CUDA module: built with it when the CUTLASS headers were found,
    available on a compute capability 9.0 GPU."""
    if not cuda["available"]:
        return {"built": cuda["built"], "available": False, "reason": cuda["reason"]}
    from maxattn._src.backends import sm90
    reason = sm90.availability_reason()
    return {"built": reason != sm90.NOT_BUILT, "available": reason is None, "reason": reason}


def collect() -> dict:
    """Everything :func:`show_config` prints, as a dict (for bug reports and tests)."""
    import jax
    import jaxlib

    import maxattn

    build = _build_info()
    devices = jax.devices()
    gpus = _jax_devices("gpu")
    cuda = _cuda_backend(build)
    info: dict[str, Any] = {
        "maxattn": getattr(maxattn, "__version__", None) or _dist_version("maxattn"),
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.machine()}",
        "jax": jax.__version__,
        "jaxlib": getattr(jaxlib, "__version__", None) or _dist_version("jaxlib"),
        "jax_cuda_plugin": _dist_version("jax-cuda13-plugin", "jax-cuda12-plugin"),
        "nvidia_cudnn_package": _dist_version("nvidia-cudnn-cu13", "nvidia-cudnn-cu12"),
        "jax_default_backend": jax.default_backend(),
        "devices": [f"{d.platform}:{d.id} {d.device_kind}" for d in devices],
        "gpus": [{"name": d.device_kind,
                  "compute_capability": getattr(d, "compute_capability", None)} for d in gpus],
        "build": build,
        "backends": {
            "cpu": _cpu_backend(),
            "cudnn": cuda,
            "sm90": _sm90_backend(cuda),
            "xla": {"built": True, "available": True, "reason": None},
        },
    }
    # What implementation=None takes for a call every fused backend runs: at head dim 128, and in the
    # cases where backends/__init__.py's order may differ.
    from maxattn._src import backends

    def first(**call) -> str:
        order = backends.auto_order(jax.default_backend(), **call)
        return next((n for n in order if info["backends"][n]["available"]), "xla")

    info["default_implementation"] = first(head_dim=128)
    info["default_implementation_by_case"] = {"head dim 64": first(head_dim=64), "head dim 256": first(head_dim=256),
                                              "segment ids": first(dense_segments=True)}
    return info


def _yes_no(flag: bool) -> str:
    return "yes" if flag else "no"


def show_config(file: Optional[TextIO] = None) -> None:
    """Prints the maxattn version, the JAX and cuDNN versions, the devices and,
    for each backend, whether it was built, whether it can run here and, if
    not, why.

    Args:
      file: where to print (default ``sys.stdout``).
    """
    out = file if file is not None else sys.stdout
    info = collect()

    def line(key: str, value: Any) -> None:
        print(f"{key:<24}{value}", file=out)

    line("maxattn", info["maxattn"])
    line("python", f"{info['python']} ({info['platform']})")
    line("jax / jaxlib", f"{info['jax']} / {info['jaxlib']}")
    line("jax CUDA plugin", info["jax_cuda_plugin"] or "not installed")
    line("nvidia-cudnn (pip)", info["nvidia_cudnn_package"] or "not installed")
    line("jax default backend", info["jax_default_backend"])
    if info["gpus"]:
        for g in info["gpus"]:
            cc = f" (compute capability {g['compute_capability']})" if g["compute_capability"] else ""
            line("GPU", f"{g['name']}{cc}")
    else:
        line("GPU", "none visible to JAX")
    cudnn = info["backends"]["cudnn"]
    line("cuDNN compiled against", cudnn["cudnn_compiled"] or "n/a")
    line("cuDNN loaded at runtime", cudnn["cudnn_runtime"] or "n/a")
    build = info["build"]
    if build:
        line("build", f"MAXATTN_CUDA={build.get('maxattn_cuda', '?')}, "
                      f"{build.get('cxx_compiler', '?')}"
                      + (f", CUDA {build['cuda_toolkit_version']}" if build.get("cuda_toolkit_version") else ""))
    print("backends:", file=out)
    for name, b in info["backends"].items():
        status = f"built: {_yes_no(b['built'])}, available: {_yes_no(b['available'])}"
        if b["reason"]:
            status += f" -- {b['reason']}"
        print(f"  {name:<8}{status}", file=out)
    default = info["default_implementation"]
    others = [f"{case}: {name!r}" for case, name in info["default_implementation_by_case"].items() if name != default]
    line("implementation=None", f"uses {default!r} on this machine" + (f" ({'; '.join(others)})" if others else ""))
