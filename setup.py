"""Build gvr: the C11 extension gvr._C always; kernels/*.cu into gvr/_lib/libgvr_cuda.so when nvcc is
found (CUDA_HOME/bin or PATH) and GVR_SKIP_CUDA is not 1.

Knobs: GVR_CUDA_ARCHS (default "90a;100a": Hopper and Blackwell machine code, plus PTX of the last
for newer chips), GVR_SKIP_CUDA=1, GVR_WERROR=1 (warnings are errors; CI sets it), CUDA_HOME.
"""
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
C_SOURCES = ["csrc/module.c", "csrc/buffer.c", "csrc/topk_cpu.c", "csrc/cuda_lib.c"]
WARN = ["-Wall", "-Wextra", "-Wshadow", "-Wstrict-prototypes", "-Wno-missing-field-initializers"]


def say(ok, what):
    print(f"gvr build: {'✓' if ok else '✗'} {what}", flush=True)


def compiler_accepts(flag):
    cc = sysconfig.get_config_var("CC") or "cc"
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "t.c")
        with open(src, "w") as f:
            f.write("int main(void) { return 0; }\n")
        cmd = cc.split() + [flag, src, "-o", os.path.join(d, "t")]
        return subprocess.run(cmd, capture_output=True).returncode == 0


def find_nvcc():
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
        return os.path.join(home, "bin", "nvcc")
    found = shutil.which("nvcc")
    if found:
        return found
    if os.path.exists("/usr/local/cuda/bin/nvcc"):
        return "/usr/local/cuda/bin/nvcc"
    return None


def cuda_gencode(archs):
    flags = []
    archs = [a.strip() for a in archs.replace(",", ";").split(";") if a.strip()]
    for a in archs:
        flags.append(f"-gencode=arch=compute_{a},code=sm_{a}")
    if archs:
        last = archs[-1].rstrip("af")
        flags.append(f"-gencode=arch=compute_{last},code=compute_{last}")
    return archs, flags


class BuildExt(build_ext):
    def build_extensions(self):
        werror = os.environ.get("GVR_WERROR") == "1"
        omp = compiler_accepts("-fopenmp")
        say(omp, "OpenMP (CPU rows in parallel)" if omp else "OpenMP not available: CPU rows run serially")
        for ext in self.extensions:
            ext.extra_compile_args = ["-std=c11", "-O3"] + WARN + (["-Werror"] if werror else [])
            if omp:
                ext.extra_compile_args.append("-fopenmp")
                ext.extra_link_args = ["-fopenmp"]
            ext.libraries = ["dl"]
        super().build_extensions()
        say(True, "gvr._C (C11 extension: buffer intake, CPU operators)")
        self.build_cuda()

    def build_cuda(self):
        if os.environ.get("GVR_SKIP_CUDA") == "1":
            say(False, "CUDA kernels skipped (GVR_SKIP_CUDA=1)")
            return
        nvcc = find_nvcc()
        if not nvcc:
            say(False, "CUDA kernels skipped: nvcc not found (set CUDA_HOME or put nvcc on PATH)")
            return
        sources = sorted(
            os.path.join("kernels", f) for f in os.listdir(os.path.join(HERE, "kernels")) if f.endswith(".cu")
        )
        if not sources:
            say(False, "CUDA kernels skipped: no kernels/*.cu")
            return
        archs, gencode = cuda_gencode(os.environ.get("GVR_CUDA_ARCHS", "90a;100a"))
        # beside gvr._C, wherever this build puts it (build/lib... or the source tree for --inplace)
        out_dir = os.path.join(os.path.dirname(os.path.abspath(self.get_ext_fullpath("gvr._C"))), "_lib")
        os.makedirs(out_dir, exist_ok=True)
        target = os.path.join(out_dir, "libgvr_cuda.so")
        cmd = [
            nvcc, "-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC,-Wall", "--cudart=static",
            "-lineinfo", "-Werror=all-warnings" if os.environ.get("GVR_WERROR") == "1" else "-w",
            "-Xcompiler", "-fvisibility=hidden", *gencode, "-o", target, *sources,
        ]
        print("gvr build:", " ".join(cmd), flush=True)
        r = subprocess.run(cmd, cwd=HERE)
        if r.returncode != 0:
            say(False, f"CUDA kernels failed to compile (nvcc exit {r.returncode})")
            if os.environ.get("GVR_REQUIRE_CUDA") == "1":
                raise SystemExit("GVR_REQUIRE_CUDA=1 and the CUDA kernels did not build")
            return
        say(True, f"CUDA kernels for {', '.join('sm_' + a for a in archs)} -> gvr/_lib/libgvr_cuda.so")


def numpy_include():
    import numpy

    return numpy.get_include()


class LazyNumpyInclude(list):
    def __init__(self):
        super().__init__()
        self._done = False

    def _fill(self):
        if not self._done:
            self._done = True
            self.append(numpy_include())

    def __iter__(self):
        self._fill()
        return super().__iter__()

    def __len__(self):
        self._fill()
        return super().__len__()

    def __getitem__(self, i):
        self._fill()
        return super().__getitem__(i)


ext = Extension("gvr._C", sources=C_SOURCES, include_dirs=LazyNumpyInclude(), depends=[
    "csrc/buffer.h", "csrc/dlpack.h", "csrc/topk_cpu.h", "csrc/cuda_lib.h", "kernels/gvr_kernels.h"])

setup(ext_modules=[ext], cmdclass={"build_ext": BuildExt})
