"""The environment fingerprint: everything outside the spec that decides which plan is valid.

A plan built on one GPU architecture, cuDNN or driver can fail or misbehave on another, so each of
these is part of every cache key. Works with no GPU and no cuDNN: the fields then say so.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
from dataclasses import dataclass

from .errors import TargetEnvError

NO_GPU = "none"


@dataclass(frozen=True)
class Environment:
    """What a built plan depends on besides its spec. Construct directly to inject one in tests."""

    gpu_name: str = NO_GPU
    compute_capability: tuple[int, int] = (0, 0)
    sm_count: int = 0
    cudnn_backend_version: int = 0
    cudnn_frontend_version: str = NO_GPU
    cuda_driver_version: int = 0
    cuda_runtime_version: int = 0
    deterministic: bool = False
    allow_tf32: bool = True

    @property
    def has_gpu(self) -> bool:
        return self.gpu_name != NO_GPU

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["compute_capability"] = list(self.compute_capability)
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "Environment":
        values = dict(data)
        values["compute_capability"] = tuple(values.get("compute_capability", (0, 0)))
        return cls(**values)


MAX_ENV_FILE_BYTES = 1 << 20  # `cudnn-graphs env` prints about a kilobyte; /dev/zero must not be read on
_INT_FIELDS = ("sm_count", "cudnn_backend_version", "cuda_driver_version", "cuda_runtime_version")
_STR_FIELDS = ("gpu_name", "cudnn_frontend_version")
_BOOL_FIELDS = ("deterministic", "allow_tf32")


def environment_from_file(path: str) -> Environment:
    """The Environment in a file `cudnn-graphs env` wrote on another machine (its whole JSON output, or
    the "environment" object alone): signatures for that machine (`check`/`warmup --target-env`).
    TargetEnvError names what is wrong: unreadable, over MAX_ENV_FILE_BYTES, not JSON, a field missing,
    unknown or of the wrong type."""
    data = _read_json(path)
    data = data.get("environment", data) if isinstance(data, dict) else data
    if not isinstance(data, dict):
        raise TargetEnvError(path, f"expected a JSON object, got {type(data).__name__}")
    _check_fields(path, data)
    return Environment.from_dict(data)


def _read_json(path: str):
    from . import _json

    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_ENV_FILE_BYTES + 1)
    except OSError as err:
        raise TargetEnvError(path, f"cannot be read ({err.strerror or err})") from None
    if len(raw) > MAX_ENV_FILE_BYTES:
        raise TargetEnvError(path, f"longer than {MAX_ENV_FILE_BYTES} bytes")
    try:
        return _json.loads(raw)
    except (ValueError, RecursionError) as err:  # JSONDecodeError, UnicodeDecodeError, a duplicate key
        raise TargetEnvError(path, f"not JSON ({err})") from None


def _check_fields(path: str, data: dict) -> None:
    """Every field of an Environment, each of its type (an empty or hand-made object must not pass for one)."""
    names = [f.name for f in dataclasses.fields(Environment)]
    for name in data:
        if name not in names:
            raise TargetEnvError(path, f"unknown field (expected {names})", name, data[name])
    for name in names:
        if name not in data:
            raise TargetEnvError(path, f"field {name!r} is missing")
        value = data[name]
        if name in _INT_FIELDS and not _natural(value):
            raise TargetEnvError(path, "expected an integer >= 0", name, value)
        if name in _STR_FIELDS and not isinstance(value, str):
            raise TargetEnvError(path, "expected a string", name, value)
        if name in _BOOL_FIELDS and not isinstance(value, bool):
            raise TargetEnvError(path, "expected true or false", name, value)
    cc = data["compute_capability"]
    if not (isinstance(cc, list) and len(cc) == 2 and all(map(_natural, cc))):
        raise TargetEnvError(path, "expected [major, minor]", "compute_capability", cc)


def _natural(value) -> bool:
    return type(value) is int and value >= 0


def environment(device: int | None = None, *, deterministic: bool = False, allow_tf32: bool = True) -> Environment:
    """The fingerprint of this process on `device` (default 0), with the session's flags."""
    base = _probe(0 if device is None else int(device))
    return dataclasses.replace(base, deterministic=bool(deterministic), allow_tf32=bool(allow_tf32))


@functools.lru_cache(maxsize=None)
def _probe(device: int) -> Environment:
    backend, frontend, runtime = _cudnn_versions()
    gpu = _gpu_properties(device)
    return Environment(
        gpu_name=gpu.get("name", NO_GPU),
        compute_capability=gpu.get("cc", (0, 0)),
        sm_count=gpu.get("sm_count", 0),
        cudnn_backend_version=backend,
        cudnn_frontend_version=frontend,
        cuda_driver_version=gpu.get("driver", 0),
        cuda_runtime_version=runtime,
    )


def _cudnn_versions() -> tuple[int, str, int]:
    """(cuDNN backend version, frontend version, the CUDA runtime cuDNN was built with), asked of the
    libcudnn the frontend loads and of the frontend's package metadata: importing it costs 70-90 ms."""
    from .execute import cudnn_backend

    try:
        frontend = frontend_version()
        backend, runtime = cudnn_backend.version(), cudnn_backend.cudart_version()
    except Exception:  # no frontend or no libcudnn: the fingerprint says so
        return 0, NO_GPU, 0
    return backend, frontend, runtime


def frontend_version() -> str:
    """The installed frontend's version (ImportError when there is none), from the dist-info beside the
    `cudnn` package that an import would load (a full metadata scan costs ~25 ms), else from the metadata."""
    import glob
    import importlib.util
    import os

    spec = importlib.util.find_spec("cudnn")
    if spec is None or not spec.origin:
        raise ImportError("no cudnn frontend package")
    site = os.path.dirname(os.path.dirname(spec.origin))
    found = glob.glob(os.path.join(site, "nvidia_cudnn_frontend-*.dist-info"))
    if len(found) == 1:
        return os.path.basename(found[0])[len("nvidia_cudnn_frontend-"):-len(".dist-info")]
    from importlib import metadata  # imports email, zipfile, csv: ~25 ms

    return metadata.version("nvidia-cudnn-frontend")


def gpu_problem(device: int = 0) -> str | None:
    """What keeps this process from planning on `device` (no driver, no GPU, no libcudnn), or None."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return "no NVIDIA driver (libcuda.so.1 cannot be loaded)"
    status = cuda.cuInit(0)
    if status != 0:
        return f"the NVIDIA driver found no usable GPU (cuInit returned {status})"
    count = ctypes.c_int(0)
    if cuda.cuDeviceGetCount(ctypes.byref(count)) != 0 or device >= count.value:
        return f"no CUDA device {device} (this machine has {count.value})"
    return libcudnn_problem()


def libcudnn_problem() -> str | None:
    """Why libcudnn cannot be loaded (the `cu12`/`cu13` extra is missing ...), or None. Building a graph
    needs it too, GPU or not: the frontend creates a cuDNN handle for every graph."""
    from .execute import cudnn_backend

    try:
        cudnn_backend.lib()
    except Exception as err:  # CudnnBackendError: no libcudnn anywhere the frontend would look
        return f"libcudnn cannot be loaded ({err})"
    return None


# CUdevice_attribute values from cuda.h (stable since CUDA 2.x).
_ATTR_SM_COUNT, _ATTR_CC_MAJOR, _ATTR_CC_MINOR = 16, 75, 76


def _gpu_properties(device: int) -> dict:
    """Ask the driver API directly: needs no CUDA toolkit, CuPy or torch, and is silent with no GPU."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return {}
    out: dict = {}
    version = ctypes.c_int(0)
    if cuda.cuDriverGetVersion(ctypes.byref(version)) == 0:
        out["driver"] = version.value
    dev = ctypes.c_int(0)
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGet(ctypes.byref(dev), device) != 0:
        return out
    name = ctypes.create_string_buffer(256)
    if cuda.cuDeviceGetName(name, 256, dev) == 0:
        out["name"] = name.value.decode(errors="replace")

    def attr(code: int) -> int:
        value = ctypes.c_int(0)
        return value.value if cuda.cuDeviceGetAttribute(ctypes.byref(value), code, dev) == 0 else 0

    out["sm_count"] = attr(_ATTR_SM_COUNT)
    out["cc"] = (attr(_ATTR_CC_MAJOR), attr(_ATTR_CC_MINOR))
    return out
