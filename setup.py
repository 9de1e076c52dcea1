"""Build of FreeToken's optional C++ kernels (freetoken.ops._qlinear_cpu, _attention_cpu,
_layers_cpu, _gated_delta_cpu, _repack_cpu and _sampling_cpu); everything else is pyproject.toml.

The extension is optional: a compiler error is reported and the install goes on without it, and at
run time freetoken.ops.qlinear falls back to torch's ops. No -march: the AVX-512 code carries
per-function target attributes and is chosen at run time by CPU feature.
"""

from __future__ import annotations

import glob
import os
import sys

from setuptools import setup

try:
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError:  # no torch in the build environment: pure-Python install
    BuildExtension = None


# Python's own CFLAGS carry -fwrapv (signed overflow wraps), which stops GCC from simplifying the
# kernels' int64 index arithmetic: the VNNI kernel ran at half speed with it. The later flag wins.
COMPILE_ARGS = ["-O3", "-fno-wrapv", "-fopenmp"]


# The extensions, the longest to compile first (they are compiled in parallel, one per core).
KERNELS = ["qlinear", "sampling", "layers", "attention", "gated_delta", "repack"]


def _extensions() -> list:
    if BuildExtension is None or sys.platform != "linux":
        return []
    return [
        CppExtension(
            name=f"freetoken.ops._{name}_cpu",
            sources=[f"freetoken/ops/csrc/{name}.cpp"],
            depends=glob.glob("freetoken/ops/csrc/*.h"),
            extra_compile_args=COMPILE_ARGS,
            extra_link_args=["-fopenmp"],
        )
        for name in KERNELS
    ]


if BuildExtension is not None:

    class OptionalBuildExtension(BuildExtension):
        """Builds the kernels if it can, one per core at a time; a failure leaves the torch fallback,
        never a failed install. Without ninja: torch's ninja build writes one build.ninja per
        build directory, which parallel extensions would share."""

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **{**kwargs, "use_ninja": False})

        def finalize_options(self) -> None:
            super().finalize_options()
            if not self.parallel:
                self.parallel = os.cpu_count() or 1

        def run(self) -> None:
            try:
                super().run()
            except Exception as err:  # compiler missing or failing: the kernel is optional
                print(f"freetoken: optional C++ kernel not built ({err}); using torch fallback", file=sys.stderr)

        def build_extension(self, ext) -> None:
            try:
                super().build_extension(ext)
            except Exception as err:
                print(f"freetoken: optional C++ kernel {ext.name} not built ({err})", file=sys.stderr)

    setup(ext_modules=_extensions(), cmdclass={"build_ext": OptionalBuildExtension})
else:
    setup()
