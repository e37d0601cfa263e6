"""Rank runtime: worker, coordinator and the messages between them."""
