"""`epd kube`: a topology as Kubernetes manifests, a base and overlays (command.py)."""
