"""The CPU fallback: the Open Inference Protocol over the core engine on the CPU.

``service`` (load models, answer V2 requests), ``app`` (the WSGI application), ``direct``
(the router's ``lambda:Invoke`` event), ``async_drain`` (the second consumer of
asynchronous requests) and ``chain`` (one state of a pipeline's Step Functions form), all
from ``settings``. The Lambda (``functions.cpu_infer.handler``) and ``spillway serve cpu``
are two transports over them.
"""
