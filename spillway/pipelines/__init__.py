"""Pipelines: several models in one request, each step on its model's own version.

``graph`` (a checked pipeline: steps in run order, tensors mapped; the
``ensemble_scheduling`` block it reads is ``spillway.models.pipeline_schema``),
``runner`` (running the steps, written once for every deployable), ``serving`` (an
pipeline served like a model: admit, run, encode), ``chain`` (one step per call, for the
Step Functions form) and ``stepcache`` (intermediate results per tenant).
"""
