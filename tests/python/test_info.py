"""maxattn.show_config / python -m maxattn.info, the build record, and the demo's extras guard."""

import io
import subprocess
import sys

import jax
import pytest

import maxattn
from maxattn._src import info


def test_show_config_reports_versions_and_backends():
    buf = io.StringIO()
    maxattn.show_config(file=buf)
    text = buf.getvalue()
    assert text.splitlines()[0].split() == ["maxattn", maxattn.__version__]
    assert f"jax / jaxlib            {jax.__version__}" in text
    for name in ("cpu", "cudnn", "sm90", "xla"):
        assert f"  {name:<8}built:" in text
    assert "cpu     built: yes, available: yes" in text   # the test install has the CPU module
    assert "xla     built: yes, available: yes" in text


def test_build_record_written_by_cmake():
    build = info.collect()["build"]
    assert build.get("maxattn_cuda") in {"AUTO", "ON", "OFF"}, build
    assert isinstance(build["cuda_module"], bool)
    assert build["cuda_module"] == info.collect()["backends"]["cudnn"]["built"]
    if not build["cuda_module"] and build["maxattn_cuda"] != "OFF":
        assert build["cuda_missing"], "a skipped cuDNN module must record what was missing"


def test_cli_entry_point():
    proc = subprocess.run([sys.executable, "-m", "maxattn.info"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "backends:" in proc.stdout and "implementation=None" in proc.stdout


def test_cuda_not_built_says_why(monkeypatch):
    real = info._module_file
    monkeypatch.setattr(info, "_module_file", lambda name: None if name.endswith("_cuda") else real(name))
    entry = info._cuda_backend({"maxattn_cuda": "AUTO", "cuda_missing": "nvcc (put it on PATH or set CUDACXX)"})
    assert not entry["built"] and not entry["available"]
    assert "missing at build time: nvcc" in entry["reason"]
    entry = info._cuda_backend({"maxattn_cuda": "OFF", "cuda_missing": ""})
    assert "MAXATTN_CUDA=OFF" in entry["reason"]


def test_cpu_import_failure_is_reported(monkeypatch):
    monkeypatch.setitem(sys.modules, "maxattn._maxattn_cpu", None)
    entry = info._cpu_backend()
    assert not entry["available"] and entry["reason"]


def test_default_implementation_on_this_machine():
    cfg = info.collect()
    first = lambda fused: next((n for n in fused if cfg["backends"][n]["available"]), "xla")
    assert cfg["default_implementation"] == first(("sm90", "cudnn") if cfg["gpus"] else ("cpu",))
    other = first(("cudnn", "sm90") if cfg["gpus"] else ("cpu",))
    assert cfg["default_implementation_by_case"] == {"head dim 64": other,
                                                     "head dim 256": cfg["default_implementation"],
                                                     "segment ids": cfg["default_implementation"]}


def test_cudnn_version_format():
    assert info._format_cudnn(91900) == "9.19.0"
    assert info._format_cudnn(92101) == "9.21.1"
    assert info._format_cudnn(None) is None


def test_demo_without_extras_says_what_to_install(monkeypatch, capsys):
    from maxattn import demo
    monkeypatch.setitem(sys.modules, "tqdm", None)   # import tqdm now raises ImportError
    assert demo.main(["--steps", "1"]) == 1
    err = capsys.readouterr().err
    assert "tqdm" in err and 'pip install "maxattn[demo]"' in err


def test_demo_guard_passes_with_extras():
    pytest.importorskip("tqdm")
    from maxattn import demo
    assert demo._missing_demo_extras() == []


def _cmake():
    import os
    import shutil
    cand = os.path.join(os.path.dirname(sys.executable), "cmake")
    return cand if os.path.exists(cand) else shutil.which("cmake")


def _configure(tmp_path, *defines):
    """CMake configure of this repository (no build), with the cudnn-frontend headers hidden."""
    import importlib.util
    import os
    import pathlib
    root = pathlib.Path(__file__).resolve().parents[2]
    hide = [str(root / ".cudnn_frontend" / "include")]
    spec = importlib.util.find_spec("cudnn")
    if spec is not None and spec.origin:
        hide.append(os.path.join(os.path.dirname(os.path.dirname(spec.origin)), "include"))
    cmd = [_cmake(), "-S", str(root), "-B", str(tmp_path), f"-DPython_EXECUTABLE={sys.executable}",
           "-DMAXATTN_BUILD_TESTS=OFF", "-DCMAKE_IGNORE_PATH=" + ";".join(hide), *defines]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def _gpu_toolchain_seen() -> bool:
    import os
    import shutil
    return bool(shutil.which("nvcc") or os.path.exists("/usr/local/cuda/bin/nvcc")
                or os.path.exists("/proc/driver/nvidia/version"))


@pytest.mark.skipif(_cmake() is None, reason="needs cmake")
def test_cmake_auto_warns_and_records_why_cuda_is_skipped(tmp_path):
    import json
    proc = _configure(tmp_path, "-DMAXATTN_CUDA=AUTO")
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((tmp_path / "_build_info.json").read_text())
    assert record["maxattn_cuda"] == "AUTO" and record["cuda_module"] is False
    assert "cudnn-frontend" in record["cuda_missing"]
    warned = "the cuDNN (GPU) module is NOT being built" in proc.stderr
    assert warned == _gpu_toolchain_seen(), proc.stderr[-3000:]   # a CMake WARNING goes to stderr


@pytest.mark.skipif(_cmake() is None, reason="needs cmake")
def test_cmake_cuda_on_fails_listing_what_is_missing(tmp_path):
    proc = _configure(tmp_path, "-DMAXATTN_CUDA=ON")
    assert proc.returncode != 0
    assert "MAXATTN_CUDA=ON but these are missing" in proc.stderr and "cudnn-frontend" in proc.stderr
