"""Mixture-of-Experts training: experts split over the ep ranks (:mod:`.sharding`), tokens sent to their
experts' owners and back (:mod:`.alltoall`), the router's load-balancing loss over the global batch
(:mod:`.router_balance`), and what a parallel model does with all three (:mod:`.training`)."""
