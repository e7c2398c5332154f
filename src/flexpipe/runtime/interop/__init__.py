"""Interop with ``torch.distributed.pipelining``: ``torch_schedules`` turns torch's built-in
schedule classes into FlexPipe schedules (``torch:NAME`` specs); ``torch_interop`` runs a FlexPipe
schedule on torch's own pipeline runtime, next to FlexPipe's executor on the same process group,
so the two can be compared."""
