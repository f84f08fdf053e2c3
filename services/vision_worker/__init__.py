"""Vision worker: one card of the vision pool; batches images and sends each image's span rows
straight to the prefill worker that asked (README.md)."""
