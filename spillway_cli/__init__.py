"""Spillway's command-line tooling: model building, deployment helpers and demos.

Nothing in the core package ``spillway`` imports this package; heavy dependencies
(torch, scikit-learn, skl2onnx) are imported lazily inside the functions that need them.

The commands are at the top (``main`` registers the ``*_cli`` groups), with the demo
(``demo``), the dashboard, the planner, the tuner and the model builders in their own
packages; ``local`` holds the local stand-ins for AWS and the local stack, which the
commands start and which never import a command.
"""
