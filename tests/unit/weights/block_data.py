"""Random GGML block bytes with valid float16 scale fields, shared by the weights tests: every
bit pattern of the quant fields is a valid block, so such data exercises a type's whole layout."""

from __future__ import annotations

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType

F16_FIELDS: dict[Q, list[int]] = {
    # byte offsets of the f16 scale fields in each block; the rest of the block is quant data
    Q.Q8_0: [0], Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2],
    Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208],
}


def block_bytes(qtype: Q, seed: int, n_blocks: int = 64) -> tuple[np.ndarray, tuple[int, int]]:
    """`n_blocks` random blocks of `qtype` as 4 rows of bytes, and the [4, K] shape they hold."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n_blocks, type_size), dtype=np.uint8)
    for offset in F16_FIELDS[qtype]:
        scales = rng.uniform(-2.0, 2.0, n_blocks).astype(np.float16)
        raw[:, offset : offset + 2] = scales.view(np.uint8).reshape(n_blocks, 2)
    return raw.reshape(4, -1), (4, n_blocks * block_size // 4)
