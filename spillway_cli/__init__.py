"""Spillway's command-line tooling: model building, deployment helpers and demos.

Nothing in the core package ``spillway`` imports this package; heavy dependencies
(torch, scikit-learn, skl2onnx) are imported lazily inside the functions that need them.
"""
