"""Receives posted off the compute thread (``flexpipe.runtime.transport.posting``): the caller
goes on while a post waits, every post is made in the order asked, a failed post is re-raised
to the op that needs it, and a forked child gets its own posting thread."""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch

from flexpipe.runtime.transport import comm, posting


class SlowTransport:
    """Stands in for ``comm.irecv``: each post waits ``delay`` s, or until ``release`` is set
    when one is given, and records its buffer and the thread that made it."""

    def __init__(self, delay: float, fail_on: int = -1,
                 release: threading.Event | None = None) -> None:
        self.delay, self.fail_on, self.release = delay, fail_on, release
        self.posted: list[int] = []
        self.threads: set[str] = set()

    def __call__(self, tensor: torch.Tensor, peer: int, group: object | None) -> object:
        if self.release is not None:
            assert self.release.wait(60.0), "the test never released the post"
        time.sleep(self.delay)
        if int(tensor[0]) == self.fail_on:
            raise RuntimeError(f"pair to rank {peer} closed")
        self.posted.append(int(tensor[0]))
        self.threads.add(threading.current_thread().name)
        return ("work", int(tensor[0]))


def _bufs(*ids: int) -> list[torch.Tensor]:
    return [torch.full((1,), float(i)) for i in ids]


def test_a_slow_post_does_not_hold_the_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()
    slow = SlowTransport(delay=0.0, release=release)
    monkeypatch.setattr(comm, "irecv", slow)
    posted = posting.Poster(threaded=True).irecv(_bufs(1, 2), peer=1, group=None)
    assert slow.posted == [] and not posted.done()  # returned while the posts still wait
    release.set()
    assert posted.works() == [("work", 1), ("work", 2)]
    assert posted.done()
    assert threading.current_thread().name not in slow.threads


def test_posts_are_made_in_the_order_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    slow = SlowTransport(delay=0.01)
    monkeypatch.setattr(comm, "irecv", slow)
    poster = posting.Poster(threaded=True)
    handles = [poster.irecv(_bufs(i), peer=0, group=None) for i in range(20)]
    assert [h.works()[0] for h in handles] == [("work", i) for i in range(20)]
    assert slow.posted == list(range(20))  # a channel matches receives in posting order


def test_a_failed_post_reaches_the_op_that_needs_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(comm, "irecv", SlowTransport(delay=0.0, fail_on=3))
    posted = posting.Poster(threaded=True).irecv(_bufs(3), peer=1, group=None)
    with pytest.raises(RuntimeError, match="pair to rank 1 closed"):
        posted.works()


def test_inline_posting_is_done_on_return(monkeypatch: pytest.MonkeyPatch) -> None:
    slow = SlowTransport(delay=0.0)
    monkeypatch.setattr(comm, "irecv", slow)
    posted = posting.Poster(threaded=False).irecv(_bufs(5), peer=1, group=None)
    assert posted.done() and posted.works() == [("work", 5)]
    assert slow.threads == {threading.current_thread().name}


def test_a_forked_child_makes_its_own_posting_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    parent = posting._pool()
    monkeypatch.setattr(posting, "_POOL", (-1, parent))  # as a child sees its parent's pool
    child = posting._pool()
    assert child is not parent
    assert posting._pool() is child


def test_a_post_that_never_ends_names_the_peer(monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()
    monkeypatch.setattr(comm, "irecv", SlowTransport(delay=0.0, release=release))
    posted = posting.Poster(threaded=True).irecv(_bufs(1), peer=3, group=None)
    with pytest.raises(comm.PeerError, match="receive from rank 3 did not end") as err:
        posted.works(datetime.timedelta(seconds=0.05))
    assert err.value.peer == 3 and err.value.timed_out
    release.set()
    assert posted.works() == [("work", 1)]  # it ends later, and is still there
