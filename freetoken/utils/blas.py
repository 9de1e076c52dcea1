"""torch's float32 GEMMs with one rounding whatever the thread count: MKL's strict conditional
numerical reproducibility.

torch's CPU float32 matmuls run in MKL, which on an Intel Xeon (2026-12-06, AVX-512 + AMX) splits a
prefill-sized GEMM's sums differently at one thread and at two: `F.linear` of [96, 1536] x [576, 1536]
differed in 16,387 of 55,296 outputs. A tensor-parallel rank runs with its share of the cores, so
its dense prefill copies rounded differently from one rank's, and the quantized decode kernel's
int8 activation rounding grew that last bit into 0.3 nats of log-probability (issue 32). MKL's
`MKL_CBWR=AUTO,STRICT` fixes the order of every GEMM sum independently of the threads (the same
case: 0 outputs differ; a 512 x 2048 x 8192 GEMM took the same time within noise).

Owns only that setting. MKL reads it at its first call, so it is set when `freetoken.ops` is first
imported, before any model runs; a value the user exported is left as it is. oneDNN's bfloat16
GEMMs have no such mode; they agreed at one and two threads in the same measurement.
"""

from __future__ import annotations

import os

MKL_MODE = "AUTO,STRICT"


def reproducible_blas() -> str:
    """Ask MKL for thread-count-independent float32 GEMMs unless the user chose a mode; the mode in force."""
    return os.environ.setdefault("MKL_CBWR", MKL_MODE)
