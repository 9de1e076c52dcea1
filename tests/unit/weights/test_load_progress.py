"""The safetensors loader's progress count (the loading bar's source): one call per tensor, the
tensor count known from the headers up front, bytes rising to the files' size."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tiny_models import write_tiny_model  # noqa: E402

from freetoken.weights.safetensors import load_safetensors_dir, shard_files  # noqa: E402


def test_safetensors_progress_counts_every_tensor_and_byte(tmp_path: Path) -> None:
    directory = write_tiny_model("gemma3", tmp_path / "tiny")
    calls: list[tuple[int, int, int, int]] = []
    tensors = load_safetensors_dir(directory, progress=lambda *count: calls.append(count))
    total_bytes = sum(f.stat().st_size for f in shard_files(directory))
    assert [c[0] for c in calls] == list(range(1, len(tensors) + 1)) and {c[1] for c in calls} == {len(tensors)}
    assert {c[3] for c in calls} == {total_bytes} and calls[-1][2] == total_bytes
    assert all(a[2] <= b[2] for a, b in zip(calls, calls[1:]))
    assert load_safetensors_dir(directory).keys() == tensors.keys()  # no callback: the same load
