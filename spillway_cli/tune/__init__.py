"""The policy tuner (``spillway tune``): recorded traffic replayed through candidate
policies with the router's own engine, to propose the cheapest one that keeps every
route's SLO."""
