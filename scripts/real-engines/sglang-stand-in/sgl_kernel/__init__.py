"""An import-only stand-in for SGLang's `sgl_kernel`, for SGLang's CPU engine on CPUs without AMX.

Why it exists: with SGLANG_USE_CPU_ENGINE=1, SGLang 0.5.23 imports `sgl_kernel` at start-up (its KV
cache move and allocation modules), but PyPI has no CPU build of it and no source, and PyPI's
`sglang-kernel` is a CUDA build that fails on `libcuda.so.1`.

Why it is safe: on a CPU without Intel AMX, SGLang logs that it "does not support Intel AMX, will
fallback to torch_native backend" and never calls these kernels; the suite runs it with
`--attention-backend torch_native`. Every name this module hands out is a function that records
the call and raises NotImplementedError, so a call can neither pass unnoticed nor compute anything.

How the suite proves it: when KVGATE_SGL_KERNEL_LOG names a file, importing this module appends the
process id to that file's name + ".imported" (so the suite knows the stand-in, not some other
`sgl_kernel`, was loaded), and every call appends the function's name to the file itself; the
real-engine suite fails if the stand-in was never imported or if that file exists after its SGLang
trials.
"""

import os

__version__ = "0.0.0+kvgate-stand-in"


def _mark_imported():
    log = os.environ.get("KVGATE_SGL_KERNEL_LOG")
    if log:
        with open(log + ".imported", "a", encoding="utf-8") as f:
            f.write(f"{os.getpid()}\n")


def _record(name):
    log = os.environ.get("KVGATE_SGL_KERNEL_LOG")
    if log:
        with open(log, "a", encoding="utf-8") as f:
            f.write(f"{os.getpid()} sgl_kernel.{name}\n")


def _stand_in(name):
    def call(*_args, **_kwargs):
        _record(name)
        raise NotImplementedError(f"sgl_kernel.{name} is kvgate's import-only stand-in and cannot run")

    call.__name__ = name
    call.__qualname__ = name
    return call


def __getattr__(name):
    # Module protocol names (__path__, __spec__, ...) must stay missing, or importlib and copy would
    # mistake them for real attributes.
    if name.startswith("__") and name.endswith("__"):
        raise AttributeError(name)
    return _stand_in(name)


_mark_imported()
