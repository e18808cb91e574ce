"""Observability and cost accounting: the Prometheus metrics every role exports (traffic,
rejections, rounds, training and sampling timings), and the communication-cost accounting
that comparisons report (bytes per aggregation, FedPhD's distance-weighted costs,
FedDiffuse's parameter counts).
"""
