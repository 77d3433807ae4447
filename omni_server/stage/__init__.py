"""Stage processes: one engine per process, driven by our own loop, reached over ZMQ."""
