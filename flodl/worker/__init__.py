"""Every rank: the worker loop, the training step, task set-up and the rank's own checkpoint part."""
