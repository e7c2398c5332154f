"""ZeroPP-style blockwise schedule (Tang et al., 2024): pipeline parallelism with FSDP, in
scheduling units of U micro-batches, written in the explicit-order DSL with the standard AG/RS
op kinds (flexpipe.ir.kinds.STANDARD)."""

from __future__ import annotations

from flexpipe.dsl.program import Program
from flexpipe.errors import ConfigError
from flexpipe.ir.op import Op
from flexpipe.ir.placement import Placement
from flexpipe.ir.schedule import Schedule


def zeropp(p: int, m: int, v: int = 2, U: int | None = None) -> Schedule:
    """Blockwise ZeroPP: micro-batches in units of U (default p); per unit and chunk one FSDP
    all-gather (AG) before its forwards and one reduce-scatter (RS) after its weight gradients,
    so FSDP traffic falls as 1/U. Unit u+1's forwards run before unit u's backwards (1F1B over
    units) and each chunk's W passes follow its unit's B passes, filling the gaps in between."""
    U = p if U is None else U
    if not isinstance(U, int) or U < 1:
        raise ConfigError(f"zeropp needs a unit size U >= 1, got {U!r}")
    prog = Program(Placement.interleaved(p, v), m, name="zeropp")
    units = [range(u, min(u + U, m)) for u in range(0, m, U)]
    for r in prog.ranks:
        chunks = [c * p + r for c in range(v)]
        order = _forward(chunks, units[0])
        for prev, unit in zip(units, units[1:], strict=False):
            order += _forward(chunks, unit) + _backward(chunks, prev)
        prog.order(r, order + _backward(chunks, units[-1]))
    return prog.build()


def _forward(chunks: list[int], unit: range) -> list[Op]:
    """Per chunk: gather its parameters once, then the unit's forwards."""
    return [op for s in chunks for op in [Op("AG", s, unit[0])] + [Op("F", s, j) for j in unit]]


def _backward(chunks: list[int], unit: range) -> list[Op]:
    """Per chunk, last first: the unit's B passes, then its W passes, then the reduce-scatter."""
    return [op for s in reversed(chunks)
            for op in [Op("B", s, j) for j in unit] + [Op("W", s, j) for j in unit]
            + [Op("RS", s, unit[0])]]
