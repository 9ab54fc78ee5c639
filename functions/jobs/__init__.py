"""The jobs function: submit and track batch jobs, and start the nightly re-scoring."""
