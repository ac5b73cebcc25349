"""A SLURM batch script's `#SBATCH` lines, read as sbatch reads them: text in, plain values out.

`submit job.sh` (and the `sbatch` console script) queues a lab's batch script unchanged. This
module only reads it: `read_script` takes the script's text and returns its interpreter (the `#!`
line), each directive this scheduler honours as the `submit` flags it stands for (`-t 10` is
`--time=10`, `--gres=gpu:1` is `--gpus=1`), and one warning per directive it ignores. The command
line parses those flags with `submit`'s own parser, before its own flags, so `submit`'s parsers
check every value and the command line wins, as sbatch's does. No I/O, no database.

sbatch's rules kept here:
- the first line must be `#!` (sbatch refuses anything else), and DOS line breaks are refused;
- directives are read only from the leading comment block: `#SBATCH` at the very start of a line,
  up to the first line that is neither blank nor a comment (later `#SBATCH` lines, and indented
  ones, are comments to sbatch; each gets a warning here, since it is likely a mistake);
- a line may hold several options; they split as a shell splits words (quotes, backslashes), and
  an unquoted `#` starts a comment;
- `--opt=value`, `--opt value`, `-t 10`, `-t10`, and unique prefixes of long names (getopt's);
- a later directive for the same setting wins over an earlier one.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass

from sae_dist.errors import UserError

DIRECTIVE = "#SBATCH"
CRLF, NUL = "\r\n", "\0"
NICE_DEFAULT = "100"  # sbatch's `--nice` without a value


@dataclass(frozen=True)
class Directive:
    """One honoured option of an `#SBATCH` line."""

    line: int  # its line in the script, from 1
    text: str  # as written: "-t 10", "--gres=gpu:1"
    argv: tuple[str, ...]  # the `submit` flags it stands for: ("--time=10",)


@dataclass(frozen=True)
class BatchScript:
    interpreter: tuple[str, ...]  # what the #! line runs the script with: ("/bin/bash",), ("/usr/bin/env", "python3")
    directives: tuple[Directive, ...]  # those honoured, in the script's order
    warnings: tuple[str, ...]  # one line each ("4: #SBATCH --partition=gpu: ... ignored"), in order


# ---- sbatch's options: what each takes, and what this scheduler makes of it ----

VALUE, FLAG, OPTIONAL = "value", "flag", "optional"  # OPTIONAL: a value only as --opt=value (getopt's `::`)

# Every option of sbatch (its man page, 23.x) that this scheduler does not honour, with what it
# takes, so that `-N 1` skips its value. Those with a reason say why in their warning.
IGNORED: dict[str, str] = {name: VALUE for name in (
    "account", "acctg-freq", "batch", "bb", "bbf", "cluster-constraint", "clusters", "comment",
    "constraint", "container", "container-id", "core-spec", "cores-per-socket", "cpu-freq", "cpus-per-gpu",
    "cpus-per-task", "deadline", "delay-boot", "distribution", "exclude", "export-file", "extra",
    "extra-node-info", "gid", "gpu-bind", "gpu-freq", "gpus-per-socket", "gpus-per-task", "gres-flags", "hint",
    "input", "kill-on-invalid-dep", "licenses", "mail-type", "mail-user", "mcs-label", "mem-bind",
    "mem-per-cpu", "mincpus", "network", "nodefile", "nodelist", "nodes", "ntasks", "ntasks-per-core",
    "ntasks-per-gpu", "ntasks-per-node", "ntasks-per-socket", "open-mode", "partition", "power", "prefer",
    "priority", "profile", "qos", "reservation", "segment", "signal", "sockets-per-node", "switches",
    "thread-spec", "threads-per-core", "time-min", "tmp", "tres-bind", "tres-per-task", "uid",
    "wait-all-nodes", "wckey", "wrap")}
IGNORED.update({name: FLAG for name in (
    "contiguous", "help", "ignore-pbs", "no-requeue", "overcommit", "oversubscribe", "quiet", "reboot",
    "spread-job", "stepmgr", "test-only", "usage", "use-min-nodes", "verbose", "version", "wait")})
IGNORED.update({name: OPTIONAL for name in ("get-user-env", "no-kill", "propagate")})

WHY_IGNORED = {
    "nodes": "this scheduler runs a job on this one machine",
    "ntasks": "the script runs once, as sbatch's batch step does; start its ranks yourself (torchrun)",
    "ntasks-per-node": "the script runs once, as sbatch's batch step does; start its ranks yourself (torchrun)",
    "cpus-per-task": "CPUs are not allocated here, only GPUs",
    "partition": "this machine has no partitions",
    "mem-per-cpu": "host memory is not scheduled here, only GPUs",
    "no-requeue": "a job is requeued here only with --requeue",
    "wrap": "give the command after --: submit -- PROGRAM ARGS",
}

# Those honoured: what each takes.
HONOURED: dict[str, str] = {
    "job-name": VALUE, "time": VALUE, "output": VALUE, "error": VALUE, "gres": VALUE, "gpus": VALUE,
    "gpus-per-node": VALUE, "array": VALUE, "dependency": VALUE, "mem": VALUE, "mem-per-gpu": VALUE,
    "exclusive": OPTIONAL, "requeue": FLAG, "begin": VALUE, "chdir": VALUE, "export": VALUE, "hold": FLAG,
    "nice": OPTIONAL, "parsable": FLAG,
}
# Honoured directives that are `submit` flags of the same meaning and spelling (one value or none).
SAME_FLAG = ("job-name", "time", "output", "error", "array", "dependency", "begin", "chdir", "export", "hold",
             "requeue", "parsable")

SHORT = {"A": "account", "a": "array", "B": "extra-node-info", "b": "begin", "C": "constraint",
         "c": "cpus-per-task", "D": "chdir", "d": "dependency", "e": "error", "F": "nodefile", "G": "gpus",
         "H": "hold", "h": "help", "i": "input", "J": "job-name", "k": "no-kill", "L": "licenses",
         "M": "clusters", "m": "distribution", "N": "nodes", "n": "ntasks", "O": "overcommit", "o": "output",
         "p": "partition", "Q": "quiet", "q": "qos", "S": "core-spec", "s": "oversubscribe", "t": "time",
         "V": "version", "v": "verbose", "W": "wait", "w": "nodelist", "x": "exclude"}

KNOWN = {**IGNORED, **HONOURED}


def _takes(name: str) -> str:
    """VALUE, FLAG or OPTIONAL; a short option's optional value is none (getopt's rule)."""
    return KNOWN[name]


# ---- reading a script ----

class _LineError(Exception):
    """A directive that cannot be honoured as written (its message names what is wrong)."""


def read_script(text: str) -> BatchScript:
    """The script's interpreter, honoured directives and warnings; a UserError for a script sbatch
    would refuse or a directive whose value is wrong (its message starts with the line number)."""
    if "\r\n" in text:
        raise UserError(f"{_line_of(text, CRLF)}: a DOS line break (\\r\\n), which bash cannot run (sbatch "
                        "refuses them too); convert the script first, e.g. dos2unix")
    if "\0" in text:
        raise UserError(f"{_line_of(text, NUL)}: a NUL byte; a batch script is text (sbatch refuses it too)")
    lines = text.split("\n")
    interpreter = parse_shebang(lines[0])
    directives: list[Directive] = []
    warnings: list[str] = []
    reading = True  # in the leading comment block
    for number, line in enumerate(lines[1:], start=2):
        stripped = line.strip()
        if _is_directive(line):
            if reading:
                try:
                    _read_line(number, line[len(DIRECTIVE):], directives, warnings)
                except _LineError as e:
                    raise UserError(f"{number}: {e}") from None
            else:
                warnings.append(f"{number}: {DIRECTIVE} after the script's first command: sbatch reads no "
                                "directive past it, nor does this; ignored")
        elif _is_directive(stripped):
            warnings.append(f"{number}: an indented {DIRECTIVE} is a comment to sbatch (the line must start "
                            f"with {DIRECTIVE}); ignored")
        elif stripped and not stripped.startswith("#"):
            reading = False
    return BatchScript(interpreter, tuple(directives), tuple(warnings))


def _line_of(text: str, what: str) -> int:
    return text.count("\n", 0, text.index(what)) + 1


def parse_shebang(first_line: str) -> tuple[str, ...]:
    """The interpreter of a `#!` line as the Linux kernel runs it: the path, and the rest of the
    line (stripped) as one argument if there is any."""
    if not first_line.startswith("#!"):
        raise UserError("1: the first line is not #! and an interpreter (e.g. #!/bin/bash); sbatch refuses "
                        "such a script too. To run a program, put it after --: submit -- PROGRAM ARGS")
    path, rest = re.fullmatch(r"[ \t]*([^ \t]*)[ \t]*(.*?)[ \t]*", first_line[2:]).groups()
    if not path:
        raise UserError("1: #! names no interpreter; write e.g. #!/bin/bash")
    return (path, rest) if rest else (path,)


def _is_directive(line: str) -> bool:
    return line.startswith(DIRECTIVE) and (len(line) == len(DIRECTIVE) or line[len(DIRECTIVE)].isspace())


def _read_line(number: int, rest: str, directives: list[Directive], warnings: list[str]) -> None:
    """The options of one #SBATCH line, added to `directives` and `warnings`."""
    try:
        tokens = shlex.split(rest, comments=True)
    except ValueError as e:  # an unclosed quote
        raise _LineError(f"{DIRECTIVE}{rest}: {str(e).lower()}") from None
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token.startswith("--") and len(token) > 2:
            written, eq, value = token[2:].partition("=")
            name, candidates = _long_name(written) if written else (None, [])
            if name is None:  # not an sbatch option: its value, if it has one, is the next word
                taken = "=" in token or i + 1 >= len(tokens) or tokens[i + 1].startswith("-")
                text = token if taken else f"{token} {tokens[i + 1]}"
                what = (f"an ambiguous abbreviation (of {', '.join('--' + c for c in candidates)})" if candidates
                        else "not an sbatch option")
                warnings.append(f"{number}: {DIRECTIVE} {text}: {what}; ignored")
                i += 1 if taken else 2
                continue
            kind = _takes(name)
            if kind == FLAG and eq:
                raise _LineError(f"{DIRECTIVE} {token}: --{name} takes no value")
            if kind == VALUE and not eq:
                if i + 1 >= len(tokens):
                    raise _LineError(f"{DIRECTIVE} {token}: --{name} needs a value on the same line")
                value, text, i = tokens[i + 1], f"{token} {tokens[i + 1]}", i + 2
            else:
                text, i = token, i + 1
            _add(number, text, name, value if (eq or kind == VALUE) else None, directives, warnings)
        elif token.startswith("-") and len(token) > 1 and token != "--":
            i = _read_short(number, tokens, i, directives, warnings)
        else:
            raise _LineError(f"{DIRECTIVE}{rest.rstrip()}: {token!r} is not an option (sbatch refuses such a "
                             "line too); options start with - or --")


def _read_short(number: int, tokens: list[str], i: int, directives: list[Directive], warnings: list[str]) -> int:
    """The short options of tokens[i] (`-H`, `-t 10`, `-t10`, `-Hv`); the index after what they used."""
    token = tokens[i]
    for at in range(1, len(token)):
        letter = token[at]
        name = SHORT.get(letter)
        if name is None:
            warnings.append(f"{number}: {DIRECTIVE} {token}: -{letter} is not an sbatch option; ignored")
            return i + 1
        if _takes(name) != VALUE:  # a flag (a short option's optional value is never taken)
            _add(number, f"-{letter}", name, None, directives, warnings)
            continue
        attached = token[at + 1:]
        if attached:  # -t10 (getopt's: -t=10 is the value "=10")
            _add(number, token if at == 1 else f"-{letter}{attached}", name, attached, directives, warnings)
            return i + 1
        if i + 1 >= len(tokens):
            raise _LineError(f"{DIRECTIVE} {token}: -{letter} needs a value on the same line")
        _add(number, f"-{letter} {tokens[i + 1]}", name, tokens[i + 1], directives, warnings)
        return i + 2
    return i + 1


def _long_name(written: str) -> tuple[str | None, list[str]]:
    """An sbatch long option by its name or a unique prefix of it (getopt_long's rule); else None,
    with the options an ambiguous prefix could mean."""
    if written in KNOWN:
        return written, []
    matches = sorted(name for name in KNOWN if name.startswith(written))
    return (matches[0], []) if len(matches) == 1 else (None, matches)


def _add(number: int, text: str, name: str, value: str | None, directives: list[Directive],
         warnings: list[str]) -> None:
    """One option: a directive (its `submit` flags) or a warning."""
    if name in IGNORED:
        why = WHY_IGNORED.get(name, "not supported here")
        warnings.append(f"{number}: {DIRECTIVE} {text}: {why}; ignored")
        return
    try:
        argv, notes = translate(name, value)
    except UserError as e:
        raise _LineError(f"{DIRECTIVE} {text}: {e}") from None
    if notes:  # one line for the directive, whatever of it is ignored
        warnings.append(f"{number}: {DIRECTIVE} {text}: {'; '.join(notes)}")
    if argv:
        directives.append(Directive(number, text, argv))


def translate(name: str, value: str | None) -> tuple[tuple[str, ...], list[str]]:
    """An honoured sbatch option as `submit` flags, with notes on what of it is ignored. Values
    are checked by `submit`'s own parsers when the flags are parsed; those that do not become a
    flag are checked here."""
    if name in SAME_FLAG:
        return ((f"--{name}={value}",) if value is not None else (f"--{name}",)), []
    if name == "nice":
        return (f"--nice={NICE_DEFAULT if value is None else value}",), []
    if name == "exclusive":
        if value is None:
            return ("--exclusive",), []
        return (), ["only the whole machine (--exclusive without a value) is offered here; ignored"]
    if name in ("gres", "gpus", "gpus-per-node"):
        count, notes = gres_gpus(value) if name == "gres" else gpu_count(value, f"--{name}")
        return ((f"--gpus={count}",) if count is not None else ()), notes
    if name in ("mem", "mem-per-gpu"):
        from scheduler.recommend import parse_memory

        try:  # a bad size is refused, as sbatch refuses it
            parse_memory(value)
        except UserError as e:
            raise UserError(f"--{name}: {e}") from None
        per = "node" if name == "mem" else "GPU"
        return (), [f"SLURM's host memory per {per}; only GPUs are scheduled here (the command line's --mem "
                    "is free memory on each GPU); ignored"]
    raise AssertionError(f"no translation for --{name}")


_COUNT = re.compile(r"[0-9]+")


def gpu_count(value: str, flag: str) -> tuple[int, list[str]]:
    """`--gpus` / `--gpus-per-node`: N or TYPE:N (the type ignored, with a note)."""
    kind, colon, count = value.rpartition(":")
    if not _COUNT.fullmatch(count):
        raise UserError(f"{flag}: {value!r} is not a GPU count; write N or TYPE:N, e.g. 2 or a100:2")
    return int(count), ([f"the GPU type {kind!r} is ignored (any free GPU is taken)"] if colon else [])


def gres_gpus(value: str) -> tuple[int | None, list[str]]:
    """`--gres=gpu:N`, `gpu:TYPE:N` or `gpu` (one), among other resources: the GPU count (None
    without a gpu entry), with notes on what is ignored."""
    count, notes = None, []
    for entry in value.split(","):
        parts = entry.strip().split(":")
        if parts[0] != "gpu":
            notes.append(f"the resource {entry.strip()!r} is not scheduled here, only gpu; ignored")
            continue
        if len(parts) > 3 or not all(parts):
            raise UserError(f"--gres: {entry!r} is not a GPU request; write gpu:N or gpu:TYPE:N")
        if len(parts) == 1:
            number = "1"
        elif len(parts) == 2:
            number = parts[1] if _COUNT.fullmatch(parts[1]) else "1"  # gpu:a100 is one a100
            if number != parts[1]:
                notes.append(f"the GPU type {parts[1]!r} is ignored (any free GPU is taken)")
        else:
            number = parts[2]
            notes.append(f"the GPU type {parts[1]!r} is ignored (any free GPU is taken)")
        if not _COUNT.fullmatch(number):
            raise UserError(f"--gres: {entry!r} has no GPU count; write gpu:N or gpu:TYPE:N")
        count = int(number)
    return count, notes


# ---- --export ----

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def parse_export(text: str, environ: Mapping[str, str]) -> tuple[bool, dict[str, str]]:
    """sbatch's `--export`: (whether the job keeps the environment every job gets here, the
    variables it sets). ALL keeps it; NONE, or a list without ALL, starts the job from a bare
    one (see scheduler.supervisor). In a list, NAME=VALUE sets NAME, and NAME alone passes
    NAME's value from `environ` (the submitting shell's; left out when unset there)."""
    items = [item.strip() for item in text.split(",")]
    if not any(items):
        raise UserError("--export: empty; give ALL, NONE, or NAME[=VALUE],... (ALL,NAME=VALUE keeps the rest)")
    keep_all, variables = False, {}
    for item in items:
        if item == "ALL":
            keep_all = True
            continue
        if item in ("NONE", "NIL"):  # NIL: older SLURM's NONE
            continue
        name, eq, value = item.partition("=")
        if not _NAME.fullmatch(name):
            raise UserError(f"--export: {item!r} in {text!r} is not NAME or NAME=VALUE (or ALL, NONE)")
        if eq:
            variables[name] = value
        elif name in environ:
            variables[name] = environ[name]
    return keep_all, variables
