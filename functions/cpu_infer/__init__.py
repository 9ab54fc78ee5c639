"""The CPU-fallback Lambda: the Open Inference Protocol over the core engine on the CPU.

Models load at init (from a repository folder or ``s3://`` into ``/tmp``) so provisioned
concurrency keeps them warm. ``handler`` takes direct-invoke events (the router's
``lambda:Invoke``) and API Gateway events; ``app`` serves the same over local HTTP.
"""
