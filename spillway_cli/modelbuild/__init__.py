"""Builders that write the demo model repository (``config.json`` + ONNX + checksums).

Use :func:`spillway_cli.modelbuild.build.build_repository`, or run
``python -m spillway_cli.modelbuild.build --out models``.
"""
