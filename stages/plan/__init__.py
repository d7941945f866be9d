"""`pipeline plan`: a run's store size, node cache, capture batch, memory and GPU-hours, on paper."""
