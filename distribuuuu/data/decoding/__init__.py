"""Image decoding: on the CPU in the loader workers (cpu.py), or a batch
of JPEGs at a time on the training device (device.py)."""
