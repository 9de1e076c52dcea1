"""The weight cache (`--weights-cache`): a second load maps what the first made, and computes the
same logits bit for bit; an entry that is corrupt, truncated, stale or made by other code is never
used (a miss: the checkpoint is read again and the entry rewritten).

Tiny random-weight checkpoints of each family (tests/tiny_models.py: safetensors, quantized at
load by `--weights int8 / int4`, Qwen3-MoE's and Gemma 4's experts included) and the bundled Gemma 3 270M Q4_K_M (its own Q4_K / Q6_K integers, the
super-block kernel's layout, and the prefill copies of `--prefill-weights auto`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from freetoken.models.load import LoadedModel, load_model
from freetoken.models.snapshot import capture
from model_harness import PagedRunner, Seq
from tiny_models import FAMILIES, write_tiny_model

IDS = [3, 17, 250, 9, 44, 101, 7, 63, 12, 200, 5]


def logits(loaded: LoadedModel, ids: list[int] = IDS) -> torch.Tensor:
    """A prefill chunk, then two decode steps through the pages: the last position's logits."""
    runner = PagedRunner(loaded.model, page_size=4, dtype=loaded.dtype)
    seq = Seq()
    runner.step([(seq, ids[:-3])])
    runner.step([(seq, ids[-3:-2])])
    return runner.step([(seq, ids[-2:])])[0][-1]


def load(
    spec: str | Path,
    cache: Path,
    weights: str = "auto",
    prefill_weights: str = "auto",
    dtype: torch.dtype = torch.float32,
) -> LoadedModel:
    """A load, and the end of its cache write (written behind the load, so a server is ready first)."""
    loaded = load_model(str(spec), dtype, torch.device("cpu"), weights, prefill_weights, weights_cache=str(cache))
    if loaded.cache_writer is not None:
        loaded.cache_writer.join()
    return loaded


def entries(cache: Path) -> list[Path]:
    return sorted(cache.glob("*.pt"))


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp(request.param)
    write_tiny_model(request.param, directory)
    return directory


@pytest.mark.parametrize("weights, prefill", [("int8", "bf16"), ("int4", "quantized"), ("bf16", "auto")])
def test_a_second_load_maps_the_first_and_computes_the_same(
    checkpoint: Path, tmp_path: Path, weights: str, prefill: str
) -> None:
    first = load(checkpoint, tmp_path, weights, prefill)
    assert not first.from_cache and len(entries(tmp_path)) == 1
    second = load(checkpoint, tmp_path, weights, prefill)
    assert second.from_cache
    assert second.formats == first.formats
    assert torch.equal(logits(second), logits(first))
    if weights != "bf16":  # the packed matrices are the file's pages, not a copy
        packed = [m.packed for m in second.model.modules() if getattr(m, "packed", None) is not None]
        assert packed and all(p.state()["form"] == "group32" for p in packed)
    other = load(checkpoint, tmp_path, "int8" if weights != "int8" else "int4", prefill)
    assert not other.from_cache and len(entries(tmp_path)) == 2  # other options: another entry beside


def test_a_load_from_the_cache_counts_the_bytes_it_checks(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ft serve's loading bar on a second start: the cached entry's bytes checked, rising to its
    size (no tensor count: the cache reads no tensor by itself); the first start counts tensors."""
    from freetoken.weights import weight_cache

    directory = tmp_path_factory.mktemp("llama")
    write_tiny_model("llama", directory)
    monkeypatch.setattr(weight_cache, "CHUNK", 4096)  # several chunks over both threads (written so too)
    first: list[tuple[int, int, int, int]] = []
    load_model(str(directory), torch.float32, torch.device("cpu"), "int8", weights_cache=str(tmp_path),
               progress=lambda *n: first.append(n)).cache_writer.join()
    assert first and first[-1][0] == first[-1][1] > 0  # from the checkpoint: every tensor
    [entry] = entries(tmp_path)
    second: list[tuple[int, int, int, int]] = []
    loaded = load_model(str(directory), torch.float32, torch.device("cpu"), "int8", weights_cache=str(tmp_path),
                        progress=lambda *n: second.append(n))
    size = entry.stat().st_size
    assert loaded.from_cache and len(second) == -(-size // 4096)
    assert all(c[:2] == (0, 0) and c[3] == size for c in second)
    assert [c[2] for c in second] == sorted(c[2] for c in second) and second[-1][2] == size


def _corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _garble_manifest(path: Path) -> None:
    path.with_suffix(".json").write_text("{not json")


def _other_key(path: Path) -> None:
    manifest = path.with_suffix(".json")
    meta = json.loads(manifest.read_text())
    meta["key"]["weights"] = "something else"
    manifest.write_text(json.dumps(meta))


@pytest.mark.parametrize("damage", [_corrupt, _truncate, _garble_manifest, _other_key])
def test_a_damaged_entry_is_a_miss_and_is_rewritten(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, damage, caplog: pytest.LogCaptureFixture
) -> None:
    directory = tmp_path_factory.mktemp("llama")
    write_tiny_model("llama", directory)
    cache = tmp_path / "cache"
    reference = logits(load(directory, cache, "int8"))
    [entry] = entries(cache)
    damage(entry)
    again = load(directory, cache, "int8")
    assert not again.from_cache
    assert "unusable" in caplog.text
    assert torch.equal(logits(again), reference)
    assert load(directory, cache, "int8").from_cache  # rewritten by the miss


def test_a_rewritten_checkpoint_makes_its_entry_stale(tmp_path: Path) -> None:
    directory = tmp_path / "llama"
    write_tiny_model("llama", directory)
    cache = tmp_path / "cache"
    load(directory, cache, "int8")
    [old] = entries(cache)
    weights = directory / "model.safetensors"
    weights.write_bytes(weights.read_bytes())  # another mtime: another file version
    assert not load(directory, cache, "int8").from_cache
    assert old not in entries(cache) and len(entries(cache)) == 1  # the stale entry was deleted


def test_off_and_offloaded_experts_write_nothing(checkpoint: Path, tmp_path: Path) -> None:
    load_model(str(checkpoint), torch.float32, torch.device("cpu"), "int8", weights_cache="off")
    load_model(
        str(checkpoint),
        torch.float32,
        torch.device("cpu"),
        "int8",
        moe_strategy="offload",
        expert_cache_gb=1.0,
        weights_cache=str(tmp_path),
    )
    assert entries(tmp_path) == []


def test_a_snapshot_of_another_model_is_refused(tmp_path: Path) -> None:
    from freetoken.errors import ModelLoadError
    from freetoken.models.snapshot import restore

    llama, gemma = tmp_path / "llama", tmp_path / "gemma3"
    write_tiny_model("llama", llama)
    write_tiny_model("gemma3", gemma)
    snapshot = capture(load(llama, tmp_path / "c", "int8").model)
    with pytest.raises(ModelLoadError):
        restore(load(gemma, tmp_path / "c", "int8").model, snapshot)


@pytest.mark.real_model
def test_the_bundled_gguf_maps_its_superblock_weights(tmp_path: Path) -> None:
    first = load("gemma3-270m", tmp_path, dtype=torch.bfloat16)
    second = load("gemma3-270m", tmp_path, dtype=torch.bfloat16)
    assert not first.from_cache and second.from_cache
    assert any("q4_k" in f for f in second.formats.values()) and second.formats == first.formats
    ids = first.tokenizer.encode("The capital of France is Paris. The capital of Italy is")
    assert torch.equal(logits(second, ids), logits(first, ids))


def test_a_stopping_engine_finishes_the_write_or_abandons_it_after_its_grace() -> None:
    """`finish_cache_write` (the engine process's shutdown) waits for the write behind the load: a
    server stopped right after it became ready still leaves its entry; a write that outlasts the
    grace is abandoned (False) instead of holding the exit past the supervisor's patience."""
    import threading

    from freetoken.models.load import finish_cache_write

    release = threading.Event()
    writer = threading.Thread(target=release.wait, daemon=True)
    writer.start()
    loaded = LoadedModel.__new__(LoadedModel)
    loaded.cache_writer = writer
    assert not finish_cache_write(loaded, 0.0)  # still writing: abandoned
    release.set()
    assert finish_cache_write(loaded, 60.0)  # joined: finished
    loaded.cache_writer = None
    assert finish_cache_write(loaded, 0.0)  # no write at all
