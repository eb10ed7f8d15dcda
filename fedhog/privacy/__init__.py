"""Privacy mathematics: mixing, clipping, noise, client sampling and accounting.

Nothing here imports Flower apps, the CLI or config parsing: every piece is a
pure function or a small class that a test can drive with hand-made tensors.
"""
