"""A direct driver of KVManager for the unit tests of tree policy, pools and the audit.

It is NOT the engine's schedule: each request gets its own chunk (no shared budget), every step
commits, and it preempts nothing by itself. Tests that need the engine's own decisions use
engine_sim.py (the real Engine over a null model). What this driver does share with it is the
content oracle: `check` runs the audit and the shadow model (shadow.py), so a hit, heal or
release pointing at the wrong page fails here too. Tokens are integers; no model."""

from __future__ import annotations

from dataclasses import dataclass, field

from freetoken.kv.manager import KVManager
from shadow import Shadow


class AuditFailed(AssertionError):
    """An audit found a violation (raised by the simulator, not by freetoken)."""


@dataclass
class SimRequest:
    rid: str
    prompt: list[int]
    max_tokens: int
    boundaries: tuple[int, ...] = ()
    output: list[int] = field(default_factory=list)
    computed: int = 0  # tokens whose K/V is written
    cached: int = 0
    scheduled: int = 0  # tokens the current step will compute

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_tokens


class Sim:
    def __init__(self, kv: KVManager, chunk: int = 8, audit_every_step: bool = True) -> None:
        self.kv = kv
        self.chunk = chunk
        self.running: dict[str, SimRequest] = {}
        self.audit_every_step = audit_every_step
        self.shadow = Shadow(kv.page_size, kv.window)

    def check(self) -> None:
        report = self.kv.audit(idle=not self.running)
        if not report.ok:
            raise AuditFailed(str(report))
        problems = self.shadow.problems(self.kv)
        if problems:
            raise AuditFailed("shadow: " + "; ".join(problems))
        st = self.kv.status()["pools"]
        for pool in st.values():
            total = pool["free"] + pool["cached"] + pool["in_use"] + pool["quarantined"]
            if total != pool["capacity"]:
                raise AuditFailed(f"status does not balance: {st}")

    def admit(self, rid: str, prompt: list[int], max_tokens: int, boundaries=(), use_cache=True):
        req = SimRequest(rid, list(prompt), max_tokens, tuple(boundaries))
        req.cached = req.computed = self.kv.admit(rid, prompt, use_cache=use_cache)
        self.shadow.admit(rid, prompt, req.cached)
        self.running[rid] = req
        return req

    def schedule(self, rid: str) -> bool:
        """Extend for the next chunk / decode token; False if it does not fit."""
        req = self.running[rid]
        if req.computed < len(req.prompt):
            n = min(self.chunk, len(req.prompt) - req.computed)
        else:
            n = 1
        if not self.kv.extend(rid, req.computed + n):
            return False
        req.scheduled = n
        return True

    def complete(self, rid: str) -> None:
        """After the forward: K/V of the scheduled tokens is written; sample, commit, release."""
        req = self.running[rid]
        full, swa = self.kv.page_tables(rid)
        self.shadow.write(rid, req.tokens, req.computed, req.scheduled, full, swa)
        was = req.computed
        req.computed += req.scheduled
        req.scheduled = 0
        if req.computed >= len(req.prompt) and req.computed == len(req.tokens):
            req.output.append(1000 + (len(req.output) * 7 + len(req.prompt)) % 50)
        # as the engine: the chunk that ends the prompt says where a resend of it would hit
        resend_at = len(req.prompt) - 1 if was < len(req.prompt) <= req.computed else None
        self.kv.commit(rid, req.tokens[: req.computed], req.boundaries, resend_at)
        self.kv.release_out_of_window(rid, req.computed)

    def step(self, *rids: str) -> bool:
        """One engine step over a batch; False (nothing run) if one does not fit."""
        for rid in rids:
            if not self.schedule(rid):
                return False
        for rid in rids:
            self.complete(rid)
        if self.audit_every_step:
            self.check()
        return True

    def finish(self, rid: str, *, commit: bool = True, preempted: bool = False) -> SimRequest:
        req = self.running.pop(rid)
        if commit:
            self.kv.commit(rid, req.tokens[: req.computed], req.boundaries)
        self.kv.release(rid, preempted=preempted)
        self.shadow.release(rid)
        if self.audit_every_step:
            self.check()
        return req

    def run_to_end(self, rid: str) -> SimRequest:
        while not self.running[rid].done:
            if not self.step(rid):
                raise AssertionError(f"{rid} does not fit")
        return self.finish(rid)
