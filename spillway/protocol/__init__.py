"""The Open Inference Protocol as the wire carries it: what every transport reads and writes.

``wire`` (headers, bodies, parameters, replies), ``codec`` and ``tensors`` (JSON tensors
and Triton's binary extension to numpy and back), ``datatypes``, ``v2`` (the pydantic
models of the V2 REST messages), ``messages`` (every message that crosses a process
boundary), ``errors`` (one hierarchy with stable codes), ``names`` and ``openapi``.
"""
