"""`ft bench load`'s machinery on a stand-in server (a few lines of http.server that answer
`/health` only once a file exists, so "ready" is an event the test causes, not a speed): the
launch is timed to ready, two completions are sent, the tree's memory and VmHWM are read, the
process is stopped; the table puts the peer beside FreeToken with a ratio."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from freetoken.bench import load

SERVER = textwrap.dedent('''
    import json, os, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer
    port, ready, hits = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    ballast = bytearray(64 * 2**20)  # touched: 64 MiB resident, so VmHWM is at least that
    for i in range(0, len(ballast), 4096):
        ballast[i] = 1
    class H(BaseHTTPRequestHandler):
        def log_message(self, *a): pass
        def answer(self, code):
            self.send_response(code); self.send_header("content-length", "2"); self.end_headers(); self.wfile.write(b"{}")
        def do_GET(self):
            if self.path == "/v1/models":
                body = json.dumps({"data": [{"id": "stand-in"}]}).encode()
                self.send_response(200); self.send_header("content-length", str(len(body))); self.end_headers(); self.wfile.write(body)
                return
            self.answer(200 if os.path.exists(ready) else 503)
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            with open(hits, "a") as f: f.write(body["model"][0])
            self.answer(200)
    open(ready, "w").close()
    HTTPServer(("127.0.0.1", port), H).serve_forever()
''')


def test_measure_times_a_launch_and_reads_the_tree_memory(tmp_path: Path) -> None:
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    port = load.free_port()
    ready, hits = tmp_path / "ready", tmp_path / "hits"
    start = load.measure("stand-in", [sys.executable, str(script), str(port), str(ready), str(hits)], port, 60, tmp_path / "log")
    assert ready.exists() and hits.read_text() == "ss"  # ready was seen, then two requests naming the served model
    assert start.ready_s > 0
    assert start.peak_mb >= 64 and start.rss_mb >= 64  # the ballast is counted
    assert start.peak_mb >= start.rss_mb * 0.99  # a high-water mark is never below the resident size


def test_measure_names_a_server_that_exits_before_ready(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="exited with 3 before it was ready"):
        load.measure("broken", [sys.executable, "-c", "raise SystemExit(3)"], load.free_port(), 60, tmp_path / "log")


def test_table_reports_first_and_later_starts_and_ratios() -> None:
    runs = [load.Start("freetoken", 10.0, 900, 1000, 950), load.Start("peer", 2.0, 800, 850, 840),
            load.Start("peer", 1.0, 800, 850, 840), load.Start("freetoken", 4.0, 900, 1000, 950),
            load.Start("freetoken", 6.0, 900, 1000, 950)]
    lines = load.table(runs).splitlines()
    assert lines[0] == "| measure | freetoken | peer | ratio |"
    first = next(line for line in lines if line.startswith("| first start"))
    later = next(line for line in lines if line.startswith("| later starts"))
    assert first == "| first start, ready (s) | 10.0 | 2.0 | 5.00x |"
    assert later == "| later starts, ready (s, median) | 5.0 | 1.0 | 5.00x |"
    # two first starts of each: their median apart, the rest after
    lines = load.table(runs, first_starts=2).splitlines()
    first = next(line for line in lines if line.startswith("| first start, ready"))
    later = next(line for line in lines if line.startswith("| later starts"))
    assert first == "| first start, ready (s, median of 2) | 7.0 | 1.5 | 4.67x |"
    assert later == "| later starts, ready (s, median) | 6.0 | 1.5 | 4.00x |"  # too few peer starts: all of them


def test_run_removes_the_weight_caches_it_made_and_keeps_the_logs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each first start gets a weight cache of its own (a copy of the model, GBs): `run` deletes
    them when done, even when a start fails, so repeated benchmarks do not fill the disk."""
    monkeypatch.setattr(load.tempfile, "mkdtemp", lambda prefix: str(tmp_path))
    made: list[Path] = []

    def fake_measure(label: str, cmd: list[str], port: int, timeout_s: float, log: Path) -> load.Start:
        log.write_text("log")
        if label == "freetoken":
            cache = Path(cmd[cmd.index("--weights-cache") + 1])
            (cache / "entry").mkdir(parents=True, exist_ok=True)
            made.append(cache)
            if len(made) == 3:
                raise RuntimeError("the third start failed")
        return load.Start(label, 1.0)

    monkeypatch.setattr(load, "measure", fake_measure)
    with pytest.raises(RuntimeError, match="third start"):
        load.run("m.gguf", "peer-binary", starts=4, threads=2, num_tokens=64, timeout_s=1, ft_extra=[], first_starts=2)
    assert {c.name for c in made} == {"weights-cache-0", "weights-cache-1"}  # later starts reuse the last
    assert not any(c.exists() for c in made)
    assert (tmp_path / "freetoken-0.log").exists() and (tmp_path / "peer-0.log").exists()
