"""The GPU check's verdict: one row a step, as a markdown table and as JSON (pure functions of
plain data, tested without a GPU in tests/test_gpu_check.py)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

VERDICTS = ("PASS", "FAIL", "TIMEOUT", "SKIP")
SKIP_EXIT = 3  # a step's script exits 3 to say it could not run here; its last line says why
DETAIL_CHARS = 240


@dataclass(frozen=True)
class Row:
    step: str
    verdict: str  # one of VERDICTS
    seconds: float | None  # None: the step did not run
    detail: str  # the step's last line (its summary), or why it did not run


def verdict_of(returncode: int | None, timed_out: bool) -> str:
    """A step's verdict from how its process ended."""
    if timed_out:
        return "TIMEOUT"
    if returncode == 0:
        return "PASS"
    return "SKIP" if returncode == SKIP_EXIT else "FAIL"


def detail_of(log: str) -> str:
    """The step's summary: the last line of its output that says something, shortened."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    if not lines:
        return "(no output)"
    last = lines[-1]
    return last if len(last) <= DETAIL_CHARS else last[: DETAIL_CHARS - 1] + "…"


def exit_code(rows: list[Row]) -> int:
    """1 when a step failed or ran out of time, else 0 (a SKIP says why and fails nothing)."""
    return 1 if any(r.verdict in ("FAIL", "TIMEOUT") for r in rows) else 0


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown(rows: list[Row], machine: dict[str, str]) -> str:
    """The table as it goes into docs/gpus.md: the machine first, then one row a step."""
    counts = {v: sum(r.verdict == v for r in rows) for v in VERDICTS}
    lines = [f"- {key}: {_cell(value)}" for key, value in machine.items()]
    lines += ["- verdicts: " + ", ".join(f"{n} {v}" for v, n in counts.items() if n), "",
              "| step | verdict | time | detail |", "|---|---|---|---|"]
    for r in rows:
        took = "-" if r.seconds is None else f"{r.seconds:.0f} s"
        lines.append(f"| {_cell(r.step)} | {r.verdict} | {took} | {_cell(r.detail)} |")
    return "\n".join(lines) + "\n"


def to_json(rows: list[Row], machine: dict[str, str]) -> str:
    return json.dumps({"machine": machine, "steps": [asdict(r) for r in rows],
                       "passed": exit_code(rows) == 0}, indent=1)
