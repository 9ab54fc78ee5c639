"""The CPU-fallback Lambda: ``handler`` adapts its events (direct invoke, API Gateway, the
async queue, the drain check, pipeline states) to the CPU fallback of ``spillway.fallback``.
"""
