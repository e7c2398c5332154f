"""Supervision of the rank processes a local launch spawns: results come back over a pipe per
rank (never through a file), and the launcher watches every rank. When one dies (killed, or
exits without reporting), fails, or stalls (the others time out waiting for it), the launcher
names that rank in a *verdict* and sends it to every rank still running: a watchdog thread in
each rank reports "stopped: <verdict>" and exits non-zero at once, even while the rank's main
thread is blocked in a transfer. Whatever is still alive after a short grace is killed, so no
process is ever left behind; a rank also exits when the launcher itself goes away.
"""

from __future__ import annotations

import os
import pickle
import signal
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from flexpipe.runtime.processes.rankstart import UNSENDABLE
from flexpipe.runtime.user.portable import unsendable

SETTLE_S = 0.3
"""After the first failure, how long to wait for the rest of the picture before judging."""
GRACE_S = 3.0
"""How long stopped ranks get to exit before they are killed."""
PEER_SETTLE_S = 1.0
"""The settle when only waiting ranks have failed yet (at most the transfer timeout): long
enough for a rank that waits on the stalled one behind the first waiter to time out too (ranks
start waiting within a step of each other), so that the blame is followed to the end of the
chain. It is most of the delay from the timeout to the verdict on a stall (2.0 s before:
timeout + 2.1 s)."""
POLL_S = 0.02
VERDICT_WAIT_S = 10.0
"""How long a failed rank stays up for the verdict (so that its neighbours are stopped with
the verdict, naming the rank at fault, rather than failing on its exit)."""


@dataclass(frozen=True)
class Failure:
    """What a failed rank reports: its message, whether it failed talking to another rank
    (``about_peer``) and which one (``peer``; None: unknown), and whether it was stopped by the
    launcher rather than failing on its own."""

    rank: int
    message: str
    peer: int | None = None
    stopped: bool = False
    about_peer: bool = False


@dataclass(frozen=True)
class Update:
    """A message a rank sends while it runs (progress), as opposed to its one final report."""

    item: Any


class Reporter:
    """The rank side: sends the rank's one report (results or a failure) to the launcher and
    runs the watchdog that obeys a verdict."""

    def __init__(self, rank: int, results: Connection, control: Connection) -> None:
        self.rank, self.results, self.control = rank, results, control
        self.lock = threading.Lock()
        self.sent = False

    def send(self, report: list[Any]) -> bool:
        """Send ``report`` unless one was sent already; whether this call sent it."""
        with self.lock:
            if self.sent:
                return False
            self.sent = True
            try:
                data = pickle.dumps(report)
            except Exception as exc:  # noqa: BLE001 - an unpicklable result is this rank's fault
                data = pickle.dumps([Failure(self.rank, f"cannot send its results: {exc}")])
            try:
                self.results.send_bytes(data)
            except OSError:
                return False
            return True

    def progress(self, item: Any) -> None:
        """Send ``item`` to the launcher now (before the final report; dropped after it)."""
        with self.lock:
            if self.sent:
                return
            try:
                self.results.send_bytes(pickle.dumps(Update(item)))
            except (OSError, pickle.PicklingError):
                pass

    def fail(self, exc: BaseException) -> None:
        """Report ``exc`` (with the rank it blames, if it names one), wait for the verdict
        (the watchdog exits on it) and exit non-zero."""
        peer = getattr(exc, "peer", None)
        text = f"{headline(exc)}\n{exc}\n{traceback.format_exc(limit=6)}"
        self.send([Failure(self.rank, text, peer if isinstance(peer, int) else None,
                           about_peer=hasattr(exc, "peer"))])
        time.sleep(VERDICT_WAIT_S)
        os._exit(1)  # do not wait for peers in the group's destructor

    def watch(self) -> None:
        """Start the watchdog thread."""
        threading.Thread(target=self._watch, name="flexpipe-watchdog", daemon=True).start()

    def _watch(self) -> None:
        try:
            verdict = str(self.control.recv())
        except (EOFError, OSError):
            if self.sent:
                return  # finished: the launcher closed the pipe
            verdict = "the launcher went away"
        self.send([Failure(self.rank, f"stopped: {verdict}", stopped=True)])
        os._exit(1)


@dataclass
class Child:
    """The launcher side of one rank: its process, the ends of its two pipes, its report."""

    rank: int
    proc: BaseProcess
    results: Connection
    control: Connection
    report: list[Any] | None = None
    exited_at: float | None = None
    pid: int = 0
    updates: list[Any] = field(default_factory=list)
    """Progress items received and not yet handed on."""

    def poll(self) -> None:
        """Take the progress updates and the report that arrived; note when the process
        exited. The exit code is read first: whatever a rank sent before it exited is then
        already in the pipe, so a rank that exited without a report is seen as such (not
        mistaken for one whose report is on its way)."""
        code = self.proc.exitcode
        while self.report is None and self.results.poll():
            try:
                message = pickle.loads(self.results.recv_bytes())
            except (EOFError, OSError, pickle.UnpicklingError):
                message = []
            if isinstance(message, Update):
                self.updates.append(message.item)
            else:
                self.report = message
        if self.exited_at is None and code is not None:
            self.exited_at = time.monotonic()

    @property
    def failure(self) -> Failure | None:
        """Its failure report, if it sent one."""
        found = [x for x in self.report or [] if isinstance(x, Failure)]
        return found[0] if found else None

    @property
    def lost(self) -> bool:
        """Exited without reporting anything: killed, died in C code, or quit (even with exit
        code 0, e.g. ``os._exit(0)`` in user code) in the middle of the run."""
        return self.exited_at is not None and not self.report

    @property
    def bad(self) -> bool:
        """Lost or failed."""
        return self.lost or self.failure is not None

    def stop(self, verdict: str) -> None:
        """Ask the rank to stop (its watchdog reports the verdict and exits)."""
        try:
            self.control.send(verdict)
        except OSError:
            pass


def exit_text(code: int | None) -> str:
    """A process exit code in words."""
    if code is None:
        return "still running"
    if code == 0:
        return "exit code 0"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}, exit code {code}"
        except ValueError:
            return f"killed by signal {-code}, exit code {code}"
    return f"exit code {code}"


@dataclass
class Verdict:
    """Which rank brought the run down (None: none in particular) and why, in one line."""

    culprit: int | None
    text: str


def judge(children: Sequence[Child], timeout_s: float) -> Verdict:
    """The verdict: a lost rank first, else a rank that failed on its own, else a rank the
    others blamed that neither answered nor reported (stalled), else the first failure."""
    lost = sorted((c for c in children if c.lost), key=lambda c: c.exited_at or 0.0)
    if lost:
        c = lost[0]
        code = c.proc.exitcode
        quiet = ", without reporting a result: it quit mid-run" if code == 0 else ""
        return Verdict(c.rank, f"rank {c.rank} lost ({exit_text(code)}{quiet})")
    failures = [c.failure for c in children if c.failure is not None]
    own = [f for f in failures if not f.about_peer and not f.stopped]
    if own:
        return Verdict(own[0].rank, f"rank {own[0].rank} failed: "
                       f"{own[0].message.splitlines()[0]}")
    for f in failures:
        found = _silent_end(children, f)
        if found is not None:
            peer, waiter = found
            return Verdict(peer, f"rank {peer} stalled: rank {waiter} waited for it past the "
                           f"{timeout_s:g}s timeout")
    first = failures[0] if failures else None
    if first is None:
        return Verdict(None, "the run failed")
    return Verdict(first.rank, f"rank {first.rank} failed: {first.message.splitlines()[0]}")


def headline(exc: BaseException) -> str:
    """``Type: the message's first line that says something`` (a message may start with a
    blank line, as torch.fx's do; the headline is what the verdict and summary show), and
    that of the deepest cause with a message when it was raised from others."""
    def first(e: BaseException) -> str:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__

    root, seen = exc, {id(exc)}
    cause = exc.__cause__
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        root = cause if str(cause).strip() else root
        cause = cause.__cause__
    return first(exc) if root is exc else f"{first(exc)} (from {first(root)})"


def _silent_end(children: Sequence[Child], failure: Failure) -> tuple[int, int] | None:
    """Follow the blame from ``failure`` (rank a waited for b, b for c, ...) to a rank that is
    still running and has not reported: (that rank, the rank that waited for it)."""
    seen: set[int] = set()
    while failure.peer is not None and 0 <= failure.peer < len(children):
        if failure.peer in seen:
            return None
        seen.add(failure.peer)
        peer = children[failure.peer]
        if peer.report is None and peer.proc.exitcode is None:
            return peer.rank, failure.rank
        follow = peer.failure
        if follow is None or follow.stopped:
            return None
        failure = follow
    return None


@dataclass
class Supervisor:
    """Watches ``children`` until all have exited (see the module docstring)."""

    children: list[Child]
    timeout_s: float
    deadline_s: float
    verdict: Verdict | None = None
    exit_codes: dict[int, int | None] = field(default_factory=dict)
    on_update: Callable[[int, Any], None] | None = None
    """Called with (rank, item) for every progress item, in the launcher, as it arrives."""

    def run(self) -> None:
        """Wait for every rank; judge and stop the rest on the first failure or the deadline;
        kill whatever outlives the grace. Always reaps every process."""
        end = time.monotonic() + self.deadline_s
        bad_since: float | None = None
        stopped_at: float | None = None
        try:
            while any(c.proc.is_alive() for c in self.children):
                now = self._tick()
                if bad_since is None and any(c.bad for c in self.children):
                    bad_since = now
                due = bad_since is not None and now - bad_since >= self._settle()
                if stopped_at is None and (due or now > end):
                    self._stop(now > end and not due)
                    stopped_at = now
                if stopped_at is not None and now - stopped_at > GRACE_S:
                    break
                time.sleep(POLL_S)
        finally:
            self._reap()
        if self.verdict is None and any(c.bad for c in self.children):
            self.verdict = judge(self.children, self.timeout_s)

    def _settle(self) -> float:
        """How long to watch after the first failure: longer when every failure so far is a
        rank waiting for another (a stalled rank's own waits time out a little later)."""
        waits = all(c.failure is not None and c.failure.about_peer
                    for c in self.children if c.bad)
        return max(SETTLE_S, min(self.timeout_s, PEER_SETTLE_S)) if waits else SETTLE_S

    def _tick(self) -> float:
        for c in self.children:
            c.poll()
            self._hand_on(c)
        return time.monotonic()

    def _hand_on(self, child: Child) -> None:
        items, child.updates = child.updates, []
        if self.on_update is not None:
            for item in items:
                self.on_update(child.rank, item)

    def _stop(self, deadline: bool) -> None:
        self.verdict = (Verdict(None, f"the run passed its deadline of {self.deadline_s:g}s")
                        if deadline else judge(self.children, self.timeout_s))
        for c in self.children:
            if c.proc.is_alive():
                c.stop(self.verdict.text)

    def _reap(self) -> None:
        for c in self.children:
            if c.proc.is_alive():
                c.proc.kill()
        for c in self.children:
            c.proc.join(5)
            c.poll()
            self._hand_on(c)
            self.exit_codes[c.rank] = c.proc.exitcode
            c.results.close()
            c.control.close()

    def summary(self) -> str:
        """The verdict and one line per rank: how it ended."""
        verdict = self.verdict or Verdict(None, "the run failed")
        lines = [verdict.text]
        for c in self.children:
            failure = c.failure
            what = failure.message.splitlines()[0] if failure else (
                "lost: exited without reporting a result" if c.lost else "finished")
            if failure and not failure.stopped and c.rank != verdict.culprit:
                what = f"[{verdict.text}] {what}"  # its own error, a consequence
            lines.append(f"rank {c.rank} ({exit_text(self.exit_codes.get(c.rank))}): {what}")
        return "\n".join(lines)


def start(ctx: Any, world: int, target: Callable[..., None],
          args: tuple[Any, ...]) -> list[Child]:
    """Spawn ``target(rank, *args, results, control)`` for every rank, with its pipes. Arguments
    that cannot be sent to a process stop the launch with an error naming the way round
    (``portable.unsendable``), the ranks already started stopped."""
    children: list[Child] = []
    for rank in range(world):
        res_read, res_write = ctx.Pipe(duplex=False)
        ctl_read, ctl_write = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=target, args=(rank, *args, res_write, ctl_read),
                           name=f"flexpipe-rank{rank}", daemon=False)
        try:
            proc.start()
        except UNSENDABLE as exc:
            for child in children:
                child.proc.kill()
            raise unsendable(exc) from exc
        res_write.close()
        ctl_read.close()
        children.append(Child(rank, proc, res_read, ctl_write, pid=proc.pid or 0))
    return children
