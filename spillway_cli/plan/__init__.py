"""The capacity and cost planner (``spillway plan``): a traffic profile priced in every
serving mode from measured throughput and latency and a dated price table."""
