"""Build gvr: the C11 extension gvr._C always (csrc/**/*.c); kernels/**/*.cu into gvr/_lib/libgvr_cuda.so
when nvcc is found (CUDA_HOME/bin, PATH or /usr/local/cuda) and GVR_SKIP_CUDA is not 1.

Each .cu file is its own nvcc job (-c), the jobs run in parallel (GVR_BUILD_JOBS, default: the CPU
count), the longest first (the last build's times, else the largest file), and print when they start
and end; the objects are then linked into one
shared library with the CUDA runtime linked statically. Objects live in the build temp directory
under a name that carries a hash of the source, every header under kernels/, nvcc and the flags:
a rebuild in the same tree (a second pip install, build_ext --inplace after editing one .cu)
compiles only what changed.

Knobs: GVR_CUDA_ARCHS (default "90a;100a": Hopper and Blackwell machine code, plus PTX of the last
for newer chips; GVR_CUDA_PTX=0 leaves that PTX out), GVR_SKIP_CUDA=1, GVR_REQUIRE_CUDA=1 (fail the
build when the kernels do not build), GVR_WERROR=1 (warnings are errors; CI sets it), GVR_BUILD_JOBS,
CUDA_HOME; GVR_PROFILE=1 (debug only: kernels with phase stamps, read by scripts/profile_phases.py).
"""
import glob
import hashlib
import json
import os
import shutil
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
WARN = ["-Wall", "-Wextra", "-Wshadow", "-Wstrict-prototypes", "-Wno-missing-field-initializers"]
NVCC_FLAGS = ["-O3", "-std=c++17", "-Xcompiler", "-fPIC,-Wall", "-Xcompiler", "-fvisibility=hidden", "-lineinfo"]
KERNEL_HEADERS = (".h", ".cuh", ".hpp", ".inl")


def rel_files(folder, suffixes):
    """Files under HERE/folder (recursive) ending in one of suffixes, as sorted relative paths."""
    found = []
    for root, _, files in os.walk(os.path.join(HERE, folder)):
        found += [os.path.relpath(os.path.join(root, f), HERE) for f in files if f.endswith(suffixes)]
    return sorted(found)


def say(ok, what):
    print(f"gvr build: {'✓' if ok else '✗'} {what}", flush=True)


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


def cuda_gencode(archs, ptx=True):
    """nvcc's -gencode flags: machine code for each arch, plus (ptx) the last arch's PTX, without its
    arch-specific suffix, for newer chips to JIT-compile. The PTX is a second front-end pass over every
    file (radix_a.cu: 38.8 s with it, 27.7 s without, on the 2-core development VM), so CI, which has
    no GPU, leaves it out (GVR_CUDA_PTX=0)."""
    flags = []
    archs = [a.strip() for a in archs.replace(",", ";").split(";") if a.strip()]
    for a in archs:
        flags.append(f"-gencode=arch=compute_{a},code=sm_{a}")
    if archs and ptx:
        last = archs[-1].rstrip("af")
        flags.append(f"-gencode=arch=compute_{last},code=compute_{last}")
    return archs, flags


def build_jobs():
    try:
        return max(1, int(os.environ.get("GVR_BUILD_JOBS") or os.cpu_count() or 1))
    except ValueError:
        raise SystemExit(f"GVR_BUILD_JOBS must be an int, got {os.environ['GVR_BUILD_JOBS']!r}")


def headers_digest():
    h = hashlib.sha256()
    for path in rel_files("kernels", KERNEL_HEADERS):
        h.update(path.encode() + b"\0")
        with open(os.path.join(HERE, path), "rb") as f:
            h.update(f.read() + b"\0")
    return h.hexdigest()


def compile_weight(src):
    """A first build's guess of a .cu file's compile time (later builds use measured times): the bytes
    of the kernels/ headers it includes, transitively, times the kernel instances it asks for (its explicit
    instantiations, `template struct ...`): template instances dominate nvcc's time, not file size."""
    seen, stack, total = set(), [os.path.join(HERE, src)], 0
    while stack:
        f = stack.pop()
        if f in seen or not os.path.exists(f):
            continue
        seen.add(f)
        with open(f, errors="replace") as fh:
            text = fh.read()
        total += len(text)
        for line in text.splitlines():
            line = line.strip()
            if line.startswith('#include "'):
                name = line.split('"')[1]
                for base in (os.path.dirname(f), os.path.join(HERE, "kernels")):
                    stack.append(os.path.normpath(os.path.join(base, name)))
    with open(os.path.join(HERE, src), errors="replace") as fh:
        instances = fh.read().count("template struct ")
    return total * (1 + instances)


class BuildExt(build_ext):
    def run(self):
        # setuptools builds --inplace (and editable) extensions in build/lib and copies them over after:
        # remember where the library must go
        self.gvr_to_source = bool(self.inplace or getattr(self, "editable_mode", False))
        super().run()

    def build_extensions(self):
        werror = os.environ.get("GVR_WERROR") == "1"
        for ext in self.extensions:
            ext.extra_compile_args = ["-std=c11", "-O3", "-pthread"] + WARN + (["-Werror"] if werror else [])
            ext.libraries = ["pthread", "dl"]
        super().build_extensions()
        say(True, "gvr._C (C11 extension: argument intake, CPU operators, pthread pool)")
        self.build_cuda()

    def build_cuda(self):
        if os.environ.get("GVR_SKIP_CUDA") == "1":
            say(False, "CUDA kernels skipped (GVR_SKIP_CUDA=1)")
            return
        nvcc = find_nvcc()
        if not nvcc:
            say(False, "CUDA kernels skipped: nvcc not found (set CUDA_HOME or put nvcc on PATH)")
            return
        sources = rel_files("kernels", (".cu",))
        if not sources:
            say(False, "CUDA kernels skipped: no kernels/**/*.cu")
            return
        ptx = os.environ.get("GVR_CUDA_PTX", "1")
        if ptx not in ("0", "1"):
            raise SystemExit(f"GVR_CUDA_PTX must be 0 or 1, got {ptx!r}")
        archs, gencode = cuda_gencode(os.environ.get("GVR_CUDA_ARCHS", "90a;100a"), ptx == "1")
        werror = ["-Werror=all-warnings"] if os.environ.get("GVR_WERROR") == "1" else ["-w"]
        # GVR_PROFILE=1: a debug library with the kernels' phase stamps (scripts/profile_phases.py)
        profile = ["-DGVR_PROFILE"] if os.environ.get("GVR_PROFILE") == "1" else []
        compile_flags = NVCC_FLAGS + werror + profile + ["-I", "kernels", *gencode]
        # beside gvr._C: the source tree (--inplace, editable) or build/lib... (wheels)
        if getattr(self, "gvr_to_source", False):
            out_dir = os.path.join(HERE, "gvr", "_lib")
        else:
            out_dir = os.path.join(os.path.dirname(os.path.abspath(self.get_ext_fullpath("gvr._C"))), "_lib")
        obj_dir = os.path.join(os.path.abspath(self.build_temp), "gvr_cuda")
        os.makedirs(out_dir, exist_ok=True)
        os.makedirs(obj_dir, exist_ok=True)
        target = os.path.join(out_dir, "libgvr_cuda.so")
        # longest jobs first: by the last build's compile times where known, else the largest file first
        times_file = os.path.join(obj_dir, "compile_seconds.json")
        try:
            with open(times_file) as f:
                times = json.load(f)
        except (OSError, ValueError):
            times = {}
        sources.sort(key=lambda p: (-times.get(p, float("inf")), -compile_weight(p), p))

        # an object's name carries the hash of everything it depends on: reuse it if it exists
        common = hashlib.sha256(("\0".join([nvcc, *compile_flags]) + headers_digest()).encode()).hexdigest()
        plan = []
        for src in sources:
            stem = src[len("kernels/"):].replace(os.sep, "_").rsplit(".", 1)[0]
            with open(os.path.join(HERE, src), "rb") as f:
                digest = hashlib.sha256(common.encode() + f.read()).hexdigest()[:16]
            obj = os.path.join(obj_dir, f"{stem}.{digest}.o")
            for stale in glob.glob(os.path.join(obj_dir, f"{stem}.*.o")):
                if stale != obj and stale.rsplit(".", 2)[0] == obj.rsplit(".", 2)[0]:
                    os.remove(stale)
            plan.append((src, obj))

        jobs = build_jobs()
        todo = [(i, src, obj) for i, (src, obj) in enumerate(plan, 1) if not os.path.exists(obj)]
        n = len(plan)
        print(f"gvr build: {len(todo)} of {n} CUDA objects to compile ({n - len(todo)} reused), {jobs} parallel "
              f"nvcc jobs, sm_{', sm_'.join(archs)}; {nvcc} {' '.join(compile_flags)}", flush=True)
        lock = threading.Lock()
        t0 = time.time()

        def compile_one(item):
            i, src, obj = item
            with lock:
                print(f"gvr build: [{i}/{n}] {src} ...", flush=True)
            start = time.time()
            tmp = obj + ".tmp.o"
            r = subprocess.run([nvcc, *compile_flags, "-c", src, "-o", tmp], cwd=HERE, capture_output=True,
                               text=True)
            with lock:
                out = (r.stdout + r.stderr).strip()
                if out:
                    print(out, flush=True)
                if r.returncode == 0:
                    os.replace(tmp, obj)
                    times[src] = round(time.time() - start, 1)
                    print(f"gvr build: [{i}/{n}] {src} {time.time() - start:.1f} s", flush=True)
                else:
                    print(f"gvr build: [{i}/{n}] {src} FAILED (nvcc exit {r.returncode}, "
                          f"{time.time() - start:.1f} s)", flush=True)
            return src if r.returncode else None

        with ThreadPoolExecutor(max_workers=jobs) as pool:
            failed = [s for s in pool.map(compile_one, todo) if s]
        if todo:
            with open(times_file, "w") as f:
                json.dump(times, f, indent=0, sort_keys=True)
        if not failed:
            tmp = target + ".tmp"
            link = [nvcc, "-shared", "--cudart=static", *gencode, "-o", tmp, *(obj for _, obj in plan)]
            r = subprocess.run(link, cwd=HERE, capture_output=True, text=True)
            if r.returncode == 0:
                os.replace(tmp, target)
            else:
                print((r.stdout + r.stderr).strip(), flush=True)
                failed = ["the link"]
        if failed:
            say(False, f"CUDA kernels failed to build: {', '.join(failed)}")
            if os.environ.get("GVR_REQUIRE_CUDA") == "1":
                raise SystemExit("GVR_REQUIRE_CUDA=1 and the CUDA kernels did not build")
            return
        ptx_note = " + PTX" if ptx == "1" else ""
        say(True, f"CUDA kernels for {', '.join('sm_' + a for a in archs)}{ptx_note} -> gvr/_lib/libgvr_cuda.so "
                  f"({n} objects, {len(todo)} compiled, {time.time() - t0:.0f} s)")


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


ext = Extension(
    "gvr._C",
    sources=rel_files("csrc", (".c",)),
    include_dirs=LazyNumpyInclude(),
    depends=rel_files("csrc", (".h",)) + rel_files("kernels", KERNEL_HEADERS),
)

setup(ext_modules=[ext], cmdclass={"build_ext": BuildExt})
