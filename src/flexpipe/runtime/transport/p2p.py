"""The pipeline's point-to-point transport: messages (``flexpipe.ir.pairs.Message``) between the
ranks of one pipeline, matched in posting order with no tags, as NCCL matches them.

Order. On every channel (sender rank -> receiver rank) the k-th send meets the k-th receive.
Before each step the receiver learns every channel's messages in the SENDER's order
(``expect``) and posts its receives in that order, whatever order its receive ops ask for them:
asking for a message posts it and every message sent before it on its channel, into buffers
held until their own op takes them (a skip edge's early message, say). A receive that cannot
be posted yet (its shapes are not known) holds back every later receive from the same rank,
and waiting for a message first posts everything before it on its channel.

Shapes, once per stage boundary. The first message across a boundary (direction, producer
stage, consumer stage) is preceded by a small metadata message (count, dtypes, shapes) in the
same channel; afterwards the receiver allocates each receive's buffers by shape directly on the
compute device. A later message whose shapes differ is refused (one shape per boundary).

Devices and streams. Tensors are sent from and received into the compute device (no host
staging). Under CUDA, sends are posted on a send stream that first waits for an event recorded
on the compute stream when the data was made, receives are allocated and posted on a receive
stream, and the op that uses a received tensor makes the compute stream wait for it (the host
does not block), so transfers overlap compute. Under gloo, receives are posted on a helper
thread, in order (``flexpipe.runtime.transport.posting``: a post can wait for the lock of a pair
the transport's thread is using), and the op that uses one first waits for its post. Under
NCCL each direction has its own process group (``groups.transfer_groups``), so a channel's
communicator carries one direction and a send never waits behind a receive from the same peer;
under gloo the transfers have one group of their own.
``connect`` opens every channel with one small exchange in a global order before the first step
(NCCL creates a pair's communicator on its first transfer, blocking both sides). Every wait
has a timeout that names the peer.

Abandoning a step. A rank whose step fails part-way calls ``abandon``: its connections in the
transfer group end (``groups.break_group``), so every peer waiting on a transfer with it fails at
once, not after its timeout; such a peer abandons in turn. The links are then replaced by new
ones on every rank (``close``, then a new ``P2P``): nothing of the abandoned step is left to be
matched with the next one's messages.

Letting go of sent tensors. A send's buffers are held until its transfer is known complete. Gloo
only says so when asked to wait (``is_completed`` stays false), and waiting on a send the
receiver has not posted can block a rank its receiver waits on; so each message may have a
*proof* (``prove_by``, from ``flexpipe.ir.consumed``): a message back from its receiver, sent
after it consumed this one. Once the proof (or a later message on its channel) has arrived, the
send is waited on, which returns at once, and dropped. The step's end waits for the rest.
"""

from __future__ import annotations

import contextlib
import datetime
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from flexpipe.errors import FlexPipeError
from flexpipe.ir.pairs import Channel, Message
from flexpipe.runtime.transport import comm, groups
from flexpipe.runtime.transport.posting import Posted, Poster

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
          torch.complex32, torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn,
          torch.float8_e5m2)
"""The dtypes a stage boundary carries, by index in its shape message (append only: every
rank reads the index back). Complex tensors cross too: Llama 4's rotary tables are complex."""
META_SIZE = 256
MAX_TENSORS = 32

Edge = tuple[str, int, int]  # (direction, producer stage, consumer stage): one stage boundary
Meta = tuple[tuple[torch.dtype, tuple[int, ...]], ...]


def _edge(msg: Message) -> Edge:
    return msg.kind, msg.src, msg.dst


def _what(msg: Message) -> str:
    kind = "activations" if msg.kind == "F" else "gradients"
    return f"{kind} of stage {msg.src} -> {msg.dst} for micro-batch {msg.mb}"


def _meta(tensors: Sequence[torch.Tensor]) -> Meta:
    return tuple((t.dtype, tuple(t.shape)) for t in tensors)


def _encode(meta: Meta, device: torch.device) -> torch.Tensor:
    vals = [len(meta)]
    for dtype, shape in meta:
        if dtype not in DTYPES:
            known = ", ".join(map(str, DTYPES))
            raise FlexPipeError(f"a stage boundary carries a tensor of dtype {dtype}, which the "
                                f"transport cannot describe (it sends {known})")
        vals += [DTYPES.index(dtype), len(shape), *shape]
    if len(vals) > META_SIZE or len(meta) > MAX_TENSORS:
        raise FlexPipeError(f"a stage boundary carries {len(meta)} tensors with too many "
                            f"dimensions to describe (limit {MAX_TENSORS} tensors)")
    return torch.tensor(vals + [0] * (META_SIZE - len(vals)), dtype=torch.int64, device=device)


def _decode(meta: torch.Tensor) -> Meta:
    vals = meta.tolist()
    out, i = [], 1
    for _ in range(vals[0]):
        dtype, ndim = DTYPES[vals[i]], vals[i + 1]
        out.append((dtype, tuple(vals[i + 2:i + 2 + ndim])))
        i += 2 + ndim
    return tuple(out)


class Sent(NamedTuple):
    """One posted send: the transport's work, the tensor it holds, its message and peer (a
    global rank)."""

    work: object
    tensor: torch.Tensor
    msg: Message
    peer: int


@dataclass
class Incoming:
    """A receive of one message from pipeline rank ``src``: posted (``buffers`` set) or still
    queued behind an earlier receive of the same channel."""

    p2p: P2P
    msg: Message
    src: int
    posted: Posted | None = None
    buffers: list[torch.Tensor] | None = None
    wanted: bool = False
    """Whether the executor asked for it (else it is only expected, in the sender's order)."""

    def get(self) -> tuple[torch.Tensor, ...]:
        """The tensors, once arrived (under CUDA the compute stream waits, not the host)."""
        self.p2p.post_through(self)
        peer = self.p2p.ranks[self.src]
        assert self.posted is not None
        for w in self.posted.works(self.p2p.timeout):
            comm.wait(w, self.p2p.stream_wait, f"{_what(self.msg)} from rank {peer}", peer)
        self.p2p.arrived(self.msg)
        assert self.buffers is not None
        if self.p2p.recv_stream is not None:
            current = torch.cuda.current_stream(self.p2p.device)
            for b in self.buffers:
                b.record_stream(current)  # used on the compute stream from now on
        return tuple(self.buffers)


@dataclass
class _Inbox:
    """Receives from one rank, in channel order, not yet posted; and a posted metadata receive
    (post, buffer) whose shapes the head waits for."""

    queue: deque[Incoming] = field(default_factory=deque)
    meta: tuple[Posted, torch.Tensor] | None = None
    waiting: dict[Message, Incoming] = field(default_factory=dict)
    """Expected receives not asked for yet (``P2P.expect``), by message."""
    wanted: int = 0
    """Receives asked for and not posted yet: the queue is posted up to the last of them."""


class P2P:
    """Point-to-point transfers between the ranks of one pipeline; ``ranks[i]`` is the global
    rank of pipeline rank i. Every rank must construct it at the same point (it creates the
    transfer groups)."""

    def __init__(self, ranks: Sequence[int], timeout_s: float, device: torch.device) -> None:
        self.ranks = list(ranks)
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.device = device
        cuda = device.type == "cuda"
        # data waits: under CUDA the compute stream waits, not the host
        self.stream_wait: datetime.timedelta | None = None if cuda else self.timeout
        self.groups = groups.transfer_groups()
        self.send_stream = torch.cuda.Stream(device) if cuda else None
        self.recv_stream = torch.cuda.Stream(device) if cuda else None
        self.poster = Poster(threaded=not cuda)  # gloo: posts off the compute thread
        self.shapes: dict[Edge, Meta] = {}
        self.sent_shapes: dict[Edge, Meta] = {}
        self.inboxes: dict[int, _Inbox] = {}
        self.sends: list[Sent] = []
        self.proofs: dict[Message, Message] = {}
        self.order: dict[Message, tuple[int, int]] = {}
        """Each expected message's (sending pipeline rank, index on its channel) this step."""
        self.progress: dict[int, int] = {}
        """Per sending pipeline rank, the highest channel index that has arrived this step."""

    def group(self, src: int, dst: int) -> object:
        """The process group of channel src -> dst (pipeline ranks)."""
        return self.groups[0] if src < dst else self.groups[1]

    def abandon(self) -> None:
        """Give up this step's transfers: end this rank's connections in the transfer groups,
        so that a peer waiting on one with it fails at once; nothing is sent or received
        through these links afterwards (``close``)."""
        for group in dict.fromkeys(self.groups):
            groups.break_group(group)
        self.sends.clear()
        self.inboxes.clear()

    def close(self) -> None:
        """Abandon, then drop the transfer groups (every rank, at the same point, before new
        links replace these)."""
        self.abandon()
        for group in dict.fromkeys(self.groups):
            groups.drop_group(group)

    def connect(self, channels: Iterable[Channel]) -> None:
        """Open each channel (pipeline ranks) with one small exchange, in the same global order
        on every rank, so each pair's first transfer never blocks another rank's."""
        me = comm.my_rank()
        for src, dst in sorted(set(channels)):
            a, b = self.ranks[src], self.ranks[dst]
            if me not in (a, b):
                continue
            one = torch.zeros(1, device=self.device)
            work = comm.isend(one, b, self.group(src, dst)) if me == a else \
                comm.irecv(one, a, self.group(src, dst))
            comm.wait(work, self.timeout, f"opening the channel {src} -> {dst}",
                      b if me == a else a)

    @contextlib.contextmanager
    def _on(self, stream: torch.cuda.Stream | None) -> Iterator[None]:
        if stream is None:
            yield
            return
        with torch.cuda.stream(stream):
            yield

    def send(self, tensors: Sequence[torch.Tensor], msg: Message, dst: int) -> None:
        """Start sending ``tensors`` (message ``msg``) to pipeline rank ``dst``."""
        peer, group = self.ranks[dst], self.group(self.me(dst), dst)
        out = [t.detach().contiguous() for t in tensors]
        meta, edge = _meta(out), _edge(msg)
        known = self.sent_shapes.get(edge)
        if known is not None and known != meta:
            raise FlexPipeError(f"{_what(msg)}: the tensors' shapes changed between micro-batches "
                                f"({known} then {meta}); a stage boundary needs one shape")
        if self.send_stream is not None:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
            self.send_stream.wait_event(ready)
        with self._on(self.send_stream):
            if known is None:
                out.insert(0, _encode(meta, self.device))
                self.sent_shapes[edge] = meta
            self.sends += [Sent(comm.isend(t, peer, group), t, msg, peer) for t in out]

    def me(self, peer: int) -> int:
        """This process's pipeline rank (``peer`` is another one, for the error message)."""
        mine = comm.my_rank()
        if mine not in self.ranks:
            raise FlexPipeError(f"rank {mine} is not in this pipeline ({self.ranks}) but "
                                f"talks to its rank {peer}")
        return self.ranks.index(mine)

    def expect(self, orders: Mapping[int, Sequence[Message]]) -> None:
        """The messages each pipeline rank sends this one in the coming step, in the sender's
        order: receives are posted in that order (each once a later one is asked for)."""
        self.order, self.progress = {}, {}
        for src, msgs in orders.items():
            inbox = self.inboxes.setdefault(src, _Inbox())
            for k, msg in enumerate(msgs):
                self.order[msg] = (src, k)
                inc = Incoming(self, msg, src)
                inbox.queue.append(inc)
                inbox.waiting[msg] = inc

    def recv(self, msg: Message, src: int) -> Incoming:
        """The receive of ``msg`` from pipeline rank ``src`` (queued now when it was not
        expected); post what can be."""
        inbox = self.inboxes.setdefault(src, _Inbox())
        inc = inbox.waiting.pop(msg, None)
        if inc is None:
            inc = Incoming(self, msg, src)
            inbox.queue.append(inc)
        if inc.buffers is None:
            inc.wanted = True
            inbox.wanted += 1
        self._pump(src, None)
        return inc

    def post_through(self, inc: Incoming) -> None:
        """Post every receive of ``inc``'s channel up to ``inc`` (waiting for shapes)."""
        if inc.buffers is None:
            self._pump(inc.src, inc)

    def _pump(self, src: int, until: Incoming | None) -> None:
        """Post queued receives from ``src`` in order while their shapes are known; with
        ``until``, wait for shapes as needed until ``until`` is posted."""
        inbox = self.inboxes[src]
        while inbox.queue and (inbox.wanted or until is not None):
            head = inbox.queue[0]
            if _edge(head.msg) not in self.shapes and not self._learn(src, inbox, head,
                                                                      block=until is not None):
                return
            self._post(head)
            inbox.queue.popleft()
            if head.wanted:
                inbox.wanted -= 1
            if head is until:
                return

    def _learn(self, src: int, inbox: _Inbox, head: Incoming, block: bool) -> bool:
        """Receive the metadata that precedes ``head``; whether its shapes are now known."""
        peer = self.ranks[src]
        if inbox.meta is None:
            buf = torch.empty(META_SIZE, dtype=torch.int64, device=self.device)
            with self._on(self.recv_stream):
                inbox.meta = (self.poster.irecv([buf], peer, self.group(src, self.me(src))), buf)
        posted, buf = inbox.meta
        if not block and not (posted.done() and
                              posted.works()[0].is_completed()):  # type: ignore[attr-defined]
            return False
        comm.wait(posted.works(self.timeout)[0], self.timeout,
                  f"the shapes of {_what(head.msg)} from rank {peer}", peer)
        self.shapes[_edge(head.msg)] = _decode(buf.cpu())  # after the wait, on this stream
        inbox.meta = None
        return True

    def _post(self, inc: Incoming) -> None:
        meta = self.shapes[_edge(inc.msg)]
        peer, group = self.ranks[inc.src], self.group(inc.src, self.me(inc.src))
        with self._on(self.recv_stream):
            inc.buffers = [torch.empty(shape, dtype=dt, device=self.device) for dt, shape in meta]
            inc.posted = self.poster.irecv(inc.buffers, peer, group)

    def flush(self) -> None:
        """Wait for every send started so far."""
        for sent in self.sends:
            comm.wait(sent.work, self.stream_wait, "a send to finish", sent.peer)
        self.sends.clear()

    def reap(self) -> None:
        """Drop sends the transport reports complete (frees their buffers; gloo never does:
        see ``arrived``)."""
        if len(self.sends) > 64:
            self.sends = [s for s in self.sends
                          if not s.work.is_completed()]  # type: ignore[attr-defined]

    def prove_by(self, proofs: Mapping[Message, Message]) -> None:
        """Per message this rank sends, the message back from its receiver whose arrival proves
        it consumed (``flexpipe.ir.consumed.proofs``)."""
        self.proofs = dict(proofs)

    def arrived(self, msg: Message) -> None:
        """``msg``'s data is here: wait on (at once) and drop every send it or an earlier
        message of its channel proves consumed."""
        src, k = self.order.get(msg, (-1, -1))
        if k <= self.progress.get(src, -1):
            return
        self.progress[src] = k
        keep = []
        for sent in self.sends:
            proof = self.order.get(self.proofs.get(sent.msg))  # type: ignore[arg-type]
            if proof is not None and proof[0] == src and proof[1] <= k:
                comm.wait(sent.work, self.stream_wait, f"{_what(sent.msg)} to finish", sent.peer)
            else:
                keep.append(sent)
        self.sends = keep
