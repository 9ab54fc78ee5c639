"""The dedicated tier: an Open Inference Protocol server that batches in-process."""
