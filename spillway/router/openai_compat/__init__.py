"""The OpenAI-compatible door of the router: ``POST /v1/embeddings`` and
``GET /v1/models[/{id}]`` over the same routing as ``/v2`` (docs/openai.md).

``door`` takes a request to ``Router.route`` and back; ``schema`` holds OpenAI's shapes
and the V2 request and answer they map to; ``catalog`` says which models are offered (the
repository's ``text_embedding`` models); ``errors`` writes every failure in OpenAI's
error shape.
"""
