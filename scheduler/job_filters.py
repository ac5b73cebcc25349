"""Which jobs a listing or a cancel names by state and by name, read as squeue (`-t`, `-n`),
sacct (`-s`, `--name`) and scancel (`-t`, `-n`) read them: a comma-separated list, states by
name or by squeue's code (PD, R, CD...), any case, and `all` for every state."""

from __future__ import annotations

from sae_dist.errors import UserError

# Every state a job here can be in, and the code squeue shows for it (the same list as the
# database's JOB_STATES; a test keeps the two alike, and this module never imports SQLAlchemy).
CODES = {"PENDING": "PD", "RUNNING": "R", "COMPLETED": "CD", "FAILED": "F", "CANCELLED": "CA",
         "TIMEOUT": "TO", "NODE_FAIL": "NF", "OUT_OF_MEMORY": "OOM"}
ACTIVE = ("PENDING", "RUNNING")  # what `queue` lists, and all `cancel` can act on


def parse_states(text: str, flag: str) -> tuple[str, ...] | None:
    """'pd,R,completed' -> ('PENDING', 'RUNNING', 'COMPLETED'); 'all' -> None (every state).
    A word that is no state is a UserError naming it and the states there are."""
    by_word = {**{state: state for state in CODES}, **{code: state for state, code in CODES.items()}}
    wanted = []
    for word in _words(text, flag, "state"):
        if word.upper() == "ALL":
            return None
        if word.upper() not in by_word:
            known = ", ".join(f"{state} ({code})" for state, code in CODES.items())
            raise UserError(f"{flag}: {word!r} is no job state; use {known}, or all")
        wanted.append(by_word[word.upper()])
    return tuple(dict.fromkeys(wanted))


def parse_names(text: str, flag: str) -> tuple[str, ...]:
    """'sweep1,sweep2' -> ('sweep1', 'sweep2'): job names, matched whole and case-sensitively."""
    return tuple(dict.fromkeys(_words(text, flag, "job name")))


def _words(text: str, flag: str, what: str) -> list[str]:
    words = [w.strip() for w in text.split(",")]
    if not all(words):
        raise UserError(f"{flag}: {text!r} has an empty {what}; write a comma-separated list, e.g. "
                        + ("PD,R" if what == "state" else "sweep1,sweep2"))
    return words
