"""nvidia-ml-py's bindings loaded at first use, NVML's return codes, and the two ways a call is
made: by name through pynvml (`call`), or straight through ctypes (`Function`, for what a
sample calls every time)."""

from __future__ import annotations

import ctypes
import importlib
import threading
from typing import Any, NewType

from sidecar.process import held

LIBRARY = "libnvidia-ml.so.1"  # the name pynvml loads on Linux
NVML_TIMEOUT_S = 5.0  # how long one GPU's read may take before it counts as hung


class _Bindings:
    """nvidia-ml-py's `pynvml`, untyped, kept behind this module and imported at first use, and
    only where the driver's library loads: on a node without GPUs its 4 MB of Python are never
    paid for."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loaded = False
        self._module: Any = None
        self.missing = ""  # why there are none: the library, or the bindings

    def forget(self) -> None:
        """Not loaded: the next `get` loads the library again."""
        with self._lock:
            self._loaded = False
            self._module = None
            self.missing = ""

    def get(self) -> Any:
        with self._lock:  # the sampler's worker threads may ask at once
            if not self._loaded:
                self._loaded = True
                self._module = self._load()
            return self._module

    def _load(self) -> Any:
        try:
            ctypes.CDLL(LIBRARY)
        except OSError as exc:
            self.missing = f"cannot load {LIBRARY}: {exc}"
            return None
        try:
            return importlib.import_module("pynvml")
        except ImportError:
            self.missing = "nvidia-ml-py is not installed"
            return None


_BINDINGS = _Bindings()
held(_BINDINGS.forget)

# NVML return codes (nvml.h, nvmlReturn_t): part of the C ABI, stable across driver versions.
INVALID_ARGUMENT = 2
NOT_SUPPORTED = 3
NO_PERMISSION = 4
NOT_FOUND = 6
INSUFFICIENT_SIZE = 7
DRIVER_NOT_LOADED = 9
TIMEOUT = 10
LIBRARY_NOT_FOUND = 12
FUNCTION_NOT_FOUND = 13
GPU_IS_LOST = 15
RESET_REQUIRED = 16
LIB_RM_VERSION_MISMATCH = 18
ARGUMENT_VERSION_MISMATCH = 25
DEPRECATED = 26

_NEVER_WORKS = frozenset({INVALID_ARGUMENT, NOT_SUPPORTED, NO_PERMISSION, FUNCTION_NOT_FOUND,
                          ARGUMENT_VERSION_MISMATCH, DEPRECATED})
_GONE = frozenset({GPU_IS_LOST, RESET_REQUIRED})

_UNAVAILABLE_REASONS = {
    LIBRARY_NOT_FOUND: "the NVIDIA driver library libnvidia-ml.so.1 is not installed",
    DRIVER_NOT_LOADED: "the NVIDIA driver is not loaded",
    LIB_RM_VERSION_MISMATCH: "libnvidia-ml.so.1 does not match the loaded NVIDIA driver",
    NO_PERMISSION: "no permission to open the NVIDIA devices",
}


class NvmlError(Exception):
    """An NVML call failed with `code` (an nvmlReturn_t)."""

    def __init__(self, code: int, text: str) -> None:
        super().__init__(text)
        self.code = code

    @property
    def unsupported(self) -> bool:
        """The call will never work on this device or driver: stop asking."""
        return self.code in _NEVER_WORKS

    @property
    def lost(self) -> bool:
        """The GPU is gone (fallen off the bus, or needs a reset)."""
        return self.code in _GONE

    def reason(self) -> str:
        """Why there is no NVML at all, in words an operator can act on."""
        return _UNAVAILABLE_REASONS.get(self.code, f"NVML failed: {self}")


Handle = NewType("Handle", object)  # an nvmlDevice_t as the bindings hand it out


def call(name: str, *args: Any) -> Any:
    """Call pynvml.`name`, turning every failure into NvmlError."""
    nv = _BINDINGS.get()
    if nv is None:
        raise NvmlError(LIBRARY_NOT_FOUND, _BINDINGS.missing)
    function = getattr(nv, name, None)
    if function is None:
        raise NvmlError(FUNCTION_NOT_FOUND, f"nvidia-ml-py has no {name}")
    try:
        return function(*args)
    except nv.NVMLError as exc:
        raise NvmlError(int(exc.value), f"{name}: {exc}") from None
    except (TypeError, getattr(nv, "NVMLLibraryMismatchError", TypeError)) as exc:
        raise NvmlError(FUNCTION_NOT_FOUND, f"{name}: {exc}") from None  # an older binding


def text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def constant(name: str, default: int) -> int:
    return int(getattr(_BINDINGS.get(), name, default))


def init() -> None:
    call("nvmlInit")


def shutdown() -> None:
    call("nvmlShutdown")


def device_count() -> int:
    return int(call("nvmlDeviceGetCount"))


def device_handle(index: int) -> Handle:
    return Handle(call("nvmlDeviceGetHandleByIndex", index))


def device_uuid(handle: Handle) -> str:
    return text(call("nvmlDeviceGetUUID", handle))


def device_name(handle: Handle) -> str:
    return text(call("nvmlDeviceGetName", handle))


def handle_address(handle: Handle) -> int:
    """The nvmlDevice_t pointer value, which events carry to say which device they are about."""
    pointer: Any = handle
    return int(ctypes.cast(pointer, ctypes.c_void_p).value or 0)


def compute_capability(handle: Handle) -> str:
    major, minor = call("nvmlDeviceGetCudaComputeCapability", handle)
    return f"{int(major)}.{int(minor)}"


def driver_version() -> str:
    return text(call("nvmlSystemGetDriverVersion"))


def cuda_driver_version() -> str:
    """The CUDA version the driver supports, e.g. 12040 -> "12.4"."""
    reported = ctypes.c_int()
    _CUDA_DRIVER_VERSION(ctypes.byref(reported))
    version = reported.value
    return f"{version // 1000}.{version % 1000 // 10}"


class Function:
    """An NVML function a sample calls: resolved once, then called straight through ctypes with
    arguments its caller built once (its output structs and their pointers).

    pynvml's wrapper does per call what never changes: it looks the function up under a lock,
    allocates the output, wraps it in byref, and its structs answer every attribute through a
    Python-level __getattribute__; that made 0.67 ms of CPU a GPU a sample. nvidia-ml-py still
    loads the library, resolves the symbol and defines the structs. The first of `names` the
    driver has is used (an older driver lacks the newer ones, or answers FUNCTION_NOT_FOUND);
    any other nonzero return code raises NvmlError.
    """

    def __init__(self, *names: str) -> None:
        self._names = names
        self._at = 0  # the name in use
        self._function: Any = None
        self._lock = threading.Lock()  # only to resolve or move on: never around a call

    def __call__(self, *args: Any) -> None:
        at = self._at
        code = (self._function or self._resolve())(*args)
        if code:
            self._failed(code, at, args)

    def _failed(self, code: int, at: int, args: tuple[Any, ...]) -> None:
        with self._lock:
            older = self._move_on(code, at)
        if not older:
            raise NvmlError(code, f"{self._names[at]}: {_error_text(code)}")
        self(*args)

    def _resolve(self) -> Any:
        with self._lock:
            while self._function is None:
                at = self._at
                try:
                    self._function = call("_nvmlGetFunctionPointer", self._names[at])
                except NvmlError as exc:
                    if not self._move_on(exc.code, at):
                        raise NvmlError(exc.code, f"{self._names[at]}: {exc}") from None
            return self._function

    def _move_on(self, code: int, at: int) -> bool:
        """After FUNCTION_NOT_FOUND from the name `at`, use the next older one (unless another
        thread already did); False where there is none."""
        if code != FUNCTION_NOT_FOUND:
            return False
        if at == self._at:
            if at + 1 == len(self._names):
                return False
            self._at, self._function = at + 1, None
        return True


_CUDA_DRIVER_VERSION = Function("nvmlSystemGetCudaDriverVersion_v2",
                                "nvmlSystemGetCudaDriverVersion")


def pynvml() -> Any:
    """The bindings, which define the structs; NvmlError where they cannot load."""
    nv = _BINDINGS.get()
    if nv is None:
        raise NvmlError(LIBRARY_NOT_FOUND, _BINDINGS.missing)
    return nv


def _error_text(code: int) -> str:
    try:
        return text(call("nvmlErrorString", code))
    except NvmlError:
        return f"NVML error {code}"
