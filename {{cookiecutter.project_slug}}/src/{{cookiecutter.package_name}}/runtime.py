"""The local tritonserver: the nvidia-pytriton wheel's (or $TRITONSERVER_HOME's) binary, its backend directory with
the Python-backend stub for this interpreter in place, and the environment the server and its stubs need.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from .paths import cache_dir


def triton_home() -> Path | None:
    """$TRITONSERVER_HOME: your own tritonserver tree (bin/tritonserver, backends/ with the Python backend
    and its stub for this interpreter already in place), used as is instead of the nvidia-pytriton wheel."""
    home = os.environ.get("TRITONSERVER_HOME")
    return Path(home) if home else None


def local_tritonserver() -> tuple[Path, Path]:
    """(tritonserver binary, backend directory): $TRITONSERVER_HOME's, else the nvidia-pytriton wheel's.

    The wheel ships one Python-backend stub per Python version; the backend directory is a copy of the
    wheel's with the stub for this interpreter in place.
    """
    home = triton_home()
    if home is not None:
        return home / "bin" / "tritonserver", home / "backends"
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the local Triton comes from the nvidia-pytriton wheel: pip install -e '.[local]'")
    home = Path(next(iter(spec.submodule_search_locations))) / "tritonserver"
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = home / "python_backend_stubs" / python / "triton_python_backend_stub"
    if not stub.is_file():
        raise RuntimeError(f"nvidia-pytriton ships no Python-backend stub for Python {python}")
    version = importlib.metadata.version("nvidia-pytriton")
    backends = cache_dir() / f"pytriton-{version}-py{python}" / "backends"
    if not (backends / "python" / stub.name).is_file():
        staging = backends.with_name(f"backends.{os.getpid()}")
        shutil.copytree(home / "backends", staging, dirs_exist_ok=True)
        shutil.copy2(stub, staging / "python" / stub.name)
        try:
            staging.rename(backends)
        except OSError:  # another process won the race: use theirs
            shutil.rmtree(staging, ignore_errors=True)
    binary = home / "bin" / "tritonserver"
    # A stub that cannot load its libraries makes Triton 2.51 wait for it until `serve --timeout`: say so now.
    missing = missing_libraries(binary, backends / "python" / stub.name, env=local_environment())
    if missing:
        raise RuntimeError(
            f"the local Triton cannot start, shared libraries not found: {', '.join(missing)} (the Python-backend "
            f"stub needs libpython{python}.so of this interpreter: a Python built with --enable-shared)"
        )
    return binary, backends


def missing_libraries(*programs: Path, env: dict[str, str]) -> list[str]:
    """The shared libraries `ldd` cannot find for these programs ([] where there is no ldd)."""
    if shutil.which("ldd") is None:
        return []
    result = subprocess.run(["ldd", *map(str, programs)], env=env, capture_output=True, text=True, timeout=60)
    return sorted({line.split("=>")[0].strip() for line in result.stdout.splitlines() if "not found" in line})


def _libpython_dir() -> list[str]:
    """This interpreter's LIBDIR, so the stub loads the same libpython: only where the loader would not find it
    anyway. A system directory (/usr/lib/x86_64-linux-gnu) on LD_LIBRARY_PATH would put its cuDNN ahead of
    torch's own, and torch fails on the GPU."""
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    arch = sysconfig.get_config_var("MULTIARCH") or ""
    system = {"/lib", "/lib64", "/usr/lib", "/usr/lib64", f"/lib/{arch}", f"/usr/lib/{arch}"}
    return [] if not libdir or os.path.normpath(libdir) in system else [libdir]


def local_environment() -> dict[str, str]:
    """The wheel's libraries and this interpreter's libpython for the server and its stubs; this venv's
    `python3` first on PATH, which is how each stub's embedded Python finds this venv's site-packages."""
    env = dict(os.environ)
    if triton_home() is not None:
        # Your own build: its libraries and libpython are on your LD_LIBRARY_PATH. (Prepending LIBDIR here
        # could shadow torch's own cuDNN/nvJPEG with a system copy of another version.)
        libs = []
    else:
        spec = importlib.util.find_spec("pytriton")
        site = Path(next(iter(spec.submodule_search_locations))).parent
        libs = [str(site / "nvidia_pytriton.libs"), *_libpython_dir()]
    env["LD_LIBRARY_PATH"] = os.pathsep.join([*libs, env.get("LD_LIBRARY_PATH", "")]).strip(os.pathsep)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env
