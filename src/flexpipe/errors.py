"""FlexPipe's error types: every problem a user can cause surfaces as one of these, with a message
that names what is wrong and where."""

from __future__ import annotations

from dataclasses import dataclass


class FlexPipeError(Exception):
    """Base of every error FlexPipe raises on bad input."""


class ParseError(FlexPipeError):
    """Malformed schedule text or CSV; names the line, the column and the offending token."""

    def __init__(self, reason: str, line: int = 0, column: int = 0, token: str = "") -> None:
        self.reason, self.line, self.column, self.token = reason, line, column, token
        where = f"line {line}, column {column}: " if line else ""
        what = f" (token {token!r})" if token else ""
        super().__init__(f"{where}{reason}{what}")


class ConfigError(FlexPipeError):
    """A cost model, model, cluster or generator parameter that is invalid."""


class RunError(FlexPipeError):
    """A real run failed while executing a valid schedule (a peer died or timed out, a process
    crashed): not the user's input, not a bug in FlexPipe's logic. Any other exception than a
    ``FlexPipeError`` is an internal error (a bug) and is never caught to go on."""


class InfeasibleError(ConfigError):
    """Valid inputs whose constraints cannot all be met: no order fits the memory limit, a
    building block does not fit its interval. A generator or search that tries alternatives
    catches this, and only this, so that invalid input or a bug is never taken for "try the
    next one"."""


@dataclass(frozen=True)
class Violation:
    """One broken rule of a schedule: which rank, which position, which op and why."""

    rule: str
    reason: str
    rank: int | None = None
    position: int | None = None
    op: str | None = None
    context: str = ""

    def __str__(self) -> str:
        where = []
        if self.rank is not None:
            where.append(f"rank {self.rank}")
        if self.position is not None:
            where.append(f"position {self.position}")
        if self.op is not None:
            where.append(f"op {self.op}")
        head = f"[{self.rule}] " + (", ".join(where) + ": " if where else "") + self.reason
        return head + ("\n" + self.context if self.context else "")


class ValidationError(FlexPipeError):
    """A schedule that breaks one or more rules; carries every violation found."""

    def __init__(self, violations: list[Violation]) -> None:
        self.violations = violations
        count = len(violations)
        lines = [f"schedule is invalid ({count} violation{'s' if count != 1 else ''}):"]
        lines += [f"  {v}".replace("\n", "\n    ") for v in violations[:20]]
        if count > 20:
            lines.append(f"  ... and {count - 20} more")
        super().__init__("\n".join(lines))


class DeadlockError(ValidationError):
    """Ranks that wait on each other in a cycle; the message names the cycle of waits."""


class PairOrderError(ValidationError):
    """Two ranks that disagree on the order of the messages between them (transfers are
    matched in order, with no tags); the message names both ranks and the first message out of
    order."""
