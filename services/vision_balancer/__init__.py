"""Vision balancer: a group's leader; gives each image to the worker with the fewest queued
patches (README.md)."""
