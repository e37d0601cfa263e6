"""Local-SGD averaging: consensus weights, divergence and (later) the weighted reduce itself."""
