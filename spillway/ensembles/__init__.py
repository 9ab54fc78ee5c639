"""Ensembles: several models in one request, each step on its model's own version.

``graph`` (a checked ensemble: steps in run order, tensors mapped; the
``ensemble_scheduling`` block it reads is ``spillway.models.ensemble_schema``),
``runner`` (running the steps, written once for every deployable), ``serving`` (an
ensemble served like a model: admit, run, encode), ``chain`` (one step per call, for the
Step Functions form) and ``stepcache`` (intermediate results per tenant).
"""
