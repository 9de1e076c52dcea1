"""Loading a safetensors checkpoint directory (single file or sharded, memory-mapped).

Owns finding the shard files of a Hugging Face style directory and returning its tensors under
their HF names. It does not interpret names or configs.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from freetoken.errors import ModelLoadError
from freetoken.weights.progress import ProgressCallback

INDEX_FILE = "model.safetensors.index.json"


def shard_files(directory: str | Path) -> list[Path]:
    """The .safetensors files of a checkpoint directory, from its index when it has one."""
    d = Path(directory)
    index = d / INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = [d / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(d.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{d} holds no .safetensors files")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ModelLoadError(f"{d}: shard files named in {INDEX_FILE} are missing: {', '.join(missing)}")
    return files


def load_safetensors_dir(
    directory: str | Path, dtype: torch.dtype | None = None, progress: ProgressCallback | None = None
) -> dict[str, torch.Tensor]:
    """All tensors of the directory by HF name; floating tensors cast to `dtype` when given.
    `progress(tensors read, tensors, bytes read, bytes)` after each tensor (bytes as stored; the
    total is the shard files' size, headers included, and the last call reports it whole).

    Files are opened memory-mapped; a tensor is materialised only when it is read (or cast).
    """
    tensors: dict[str, torch.Tensor] = {}
    files = shard_files(directory)
    total = total_bytes = done = done_bytes = 0
    if progress is not None:  # the headers only: cheap
        for path in files:
            try:
                with safe_open(str(path), framework="pt") as f:
                    total += len(list(f.keys()))
            except Exception as err:
                raise ModelLoadError(f"{path} is not a readable safetensors file ({err})") from None
            total_bytes += path.stat().st_size
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    t = f.get_tensor(name)
                    done += 1
                    done_bytes += t.numel() * t.element_size()
                    if dtype is not None and t.is_floating_point():
                        t = t.to(dtype)
                    tensors[name] = t
                    if progress is not None:
                        progress(
                            done, total, total_bytes if done == total else min(done_bytes, total_bytes), total_bytes
                        )
        except ModelLoadError:
            raise
        except Exception as err:
            raise ModelLoadError(f"{path} is not a readable safetensors file ({err})") from None
    return tensors
