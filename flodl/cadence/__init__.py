"""Pure cadence logic (ElChe balancer, convergence guards): no torch.distributed, no I/O."""
