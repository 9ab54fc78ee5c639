"""Models: where they live, how they are configured, loaded and run.

``repository`` (a folder or an S3 prefix), ``config`` (Triton's configuration plus the
``spillway`` block; the blocks it holds for other layers are ``pipeline_schema``, a
pipeline's ``ensemble_scheduling``, and ``canary_spec``, the initial canary), ``loader``
(one way to load a version), ``engine`` (one ONNX Runtime session per version) and
``processing`` (prepare and finish steps per model kind).
"""
