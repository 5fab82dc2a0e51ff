"""Benchmarks of CCM against full context and no context, side by side in one run: KV memory, latency per
turn, batched throughput, training speed and compression overhead. Run `python -m benchmarks --help`."""
