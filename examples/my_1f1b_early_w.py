"""A schedule written from scratch in the FlexPipe DSL: 1F1B with the backward split, where each
rank runs the weight gradient of the previous micro-batch right after its next forward (W slips
one step, so B reaches the previous rank sooner). Try:

    flexpipe show examples/my_1f1b_early_w.py -p 4 -m 8
"""

from flexpipe.dsl import Placement, Program, alternate, entry


@entry
def w_slip(p: int, m: int) -> Program:
    prog = Program(Placement.linear(p), m, name="1f1b-w-slip")
    for r in prog.ranks:
        fs, bs, ws = prog.queue(r, "F"), prog.queue(r, "B"), prog.queue(r, "W")
        warm = fs.take(p - 1 - r)
        steady, backs = [], 0
        for op in alternate(fs, bs) + list(bs):
            steady.append(op)
            backs += op.kind == "B"
            if op.kind == "F" and backs > m - len(ws):  # a B ran whose W is still due
                steady.append(ws.pop())
        prog.order(r, warm, steady, ws)
    return prog
